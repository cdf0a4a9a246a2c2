"""`gptlocal plan`'s per-stage numbers against values computed by hand (in the comments), for three
layouts: pp 2 under 1F1B with the parallel optimizer off and on, and mp 4 with sequence parallel and
full recompute. A wrong count of micro-batches in flight or of optimizer sharding changes them."""
import pytest

from mindformers_gptlocal.plan.report import plan

# h 64, 4 heads, ffn 256, vocab 512, 64 positions, seq 64, 4 layers, fp32 (4 bytes), no dropout, batch 2
MODEL = dict(model_type="gpt_local", architectures=["GPTLocalForCausalLM"], hidden_size=64, num_attention_heads=4,
             intermediate_size=256, vocab_size=512, max_position_embeddings=64, seq_length=64, num_hidden_layers=4,
             hidden_dropout=0.0, attention_dropout=0.0)


def _yaml(parallel_config, parallel_optimizer=False, recompute=False):
    return {"use_parallel": True, "context": {"device_target": "Ascend"}, "runner_config": {"batch_size": 2},
            "model": {"model_config": dict(MODEL)}, "parallel_config": parallel_config,
            "parallel": {"enable_parallel_optimizer": parallel_optimizer},
            "recompute_config": {"recompute": recompute}}


# dp 2, mp 2, pp 2, micro_batch_num 4. Per layer and mp rank: qkv 3*64*64/2 + 3*64/2 = 6,240; out-proj
# 64*64/2 + 64 (bias whole) = 2,112; fc1 256*64/2 + 256/2 = 8,320; fc2 64*256/2 + 64 = 8,256; two norms
# 4*64 = 256: 25,184. Stage 0: 2 layers + token table 512*64 = 32,768 + positions 64*64 = 4,096 -> 87,232.
# Stage 1: 2 layers + final norm 128 + the tied head's copy of the table 32,768 -> 83,264.
PP2_PARAMS = [87_232, 83_264]
# Activations of one micro-batch (tokens 2*64 = 128): a layer keeps its two norms' inputs and outputs
# 128*64*16 = 131,072, Q K V and context 128*64*16/2 = 65,536, softmax out 2*4*64*64/2*4 = 65,536, fc1 and
# activation outputs 2 * 128*256*4/2 = 131,072: 393,216. Stage 0: 2 layers + the embedding output
# 128*64*4 = 32,768 -> 819,200; under 1F1B it holds pp - 0 = 2 micro-batches: 1,638,400.
# Stage 1: 2 layers + final norm in/out 128*64*8 = 65,536 + four fp32 [128, 512] logits buffers 1,048,576
# -> 1,900,544, one micro-batch in flight.
PP2_ACTIVATIONS = [1_638_400, 1_900_544]


@pytest.mark.parametrize("parallel_optimizer", [False, True], ids=["optimizer whole", "optimizer sharded over dp"])
def test_pipeline_stages_under_1f1b(parallel_optimizer):
    result = plan(_yaml({"data_parallel": 2, "model_parallel": 2, "pipeline_stage": 2, "micro_batch_num": 4},
                        parallel_optimizer), devices=8)
    assert result["problems"] == []
    for stage, params, activations in zip(result["stages"], PP2_PARAMS, PP2_ACTIVATIONS):
        moments = params * 8 // (2 if parallel_optimizer else 1)  # two fp32 moments, split over dp 2 or not
        assert stage["params"] == params
        assert (stage["weights_bytes"], stage["grads_bytes"], stage["optimizer_bytes"]) == (params * 4, params * 4,
                                                                                              moments)
        assert stage["activation_bytes"] == activations
        assert stage["total_bytes"] == params * 8 + moments + activations
    assert [st["in_flight_micro_batches"] for st in result["stages"]] == [2, 1]
    # 3,034,112 / 3,232,768 bytes (optimizer whole); 2,685,184 / 2,899,712 (sharded)
    expected = [3_034_112, 3_232_768] if not parallel_optimizer else [2_685_184, 2_899_712]
    assert [st["total_bytes"] for st in result["stages"]] == expected


def test_tensor_and_sequence_parallel_with_full_recompute():
    # dp 2, mp 4, one stage. Per layer and rank: qkv 3,072 + 48, out-proj 1,024 + 64, fc1 4,096 + 64,
    # fc2 4,096 + 64, norms 256: 12,784; 4 layers 51,136 + table 32,768 + positions 4,096 + final norm 128.
    params = 88_128
    # Full recompute keeps each layer's input, split over mp by sequence parallel: 128*64*4/4 = 8,192 a layer;
    # plus one layer rebuilt in the backward: norms 128*64*16/4 = 32,768, QKV + context 32,768, softmax
    # 2*4*64*64/4*4 = 32,768, fc1 + activation 2 * 128*256*4/4 = 65,536 -> 163,840; embedding 32,768;
    # head 1,114,112 (as above; the vocabulary is not split).
    activations = 4 * 8_192 + 163_840 + 32_768 + 1_114_112
    result = plan(_yaml({"data_parallel": 2, "model_parallel": 4, "use_seq_parallel": True}, recompute=True),
                  devices=8)
    assert result["problems"] == []
    (stage,) = result["stages"]
    assert stage["recompute"] == "full" and stage["params"] == params
    assert stage["activation_bytes"] == activations == 1_343_488
    assert stage["total_bytes"] == params * 16 + activations == 2_753_536
