"""`linrnn-serve bench batched` (benchmarks/batched.py) and the decode floor (benchmarks/floor.py)."""
from __future__ import annotations

import json

import pytest
import torch

from linrnn_bench import batched
from linrnn_bench.floor import ModelBytes, experts_touched
from linrnn_serve.cache import HybridStateCache, PagedKVCache
from linrnn_serve.config import ModelConfig
from linrnn_serve.models.loading import quant_plan
from linrnn_serve.models.registry import build_model
from linrnn_serve.presets import PRESETS, nvfp4_experts_quantization

# a small Qwen3.5-MoE: 3 GDN + 1 attention layers
H, V, HK, HV, DK, DV, KC = 64, 128, 2, 4, 16, 16, 4
HQ, HKV, D = 4, 2, 32
E, TOPK, I, I_SHARED = 8, 2, 32, 32


def small_config(quantized: bool = False) -> ModelConfig:
    text = dict(model_type="qwen3_5_moe_text", vocab_size=V, hidden_size=H, num_hidden_layers=4,
                num_attention_heads=HQ, num_key_value_heads=HKV, head_dim=D, linear_num_key_heads=HK,
                linear_num_value_heads=HV, linear_key_head_dim=DK, linear_value_head_dim=DV,
                linear_conv_kernel_dim=KC, num_experts=E, num_experts_per_tok=TOPK, moe_intermediate_size=I,
                shared_expert_intermediate_size=I_SHARED, max_position_embeddings=4096)
    raw = {"model_type": "qwen3_5_moe", "architectures": ["Qwen3_5MoeForConditionalGeneration"], "text_config": text}
    if quantized:
        raw["quantization_config"] = nvfp4_experts_quantization()
    return ModelConfig.from_dict(raw)


def hand_nonexpert_bytes() -> int:
    """Every parameter but the routed experts and the embedding table, by hand (bf16 = 2 B; the GDN
    A_log / dt_bias are f32)."""
    conv_dim, value_dim = 2 * HK * DK + HV * DV, HV * DV
    gdn = H * (conv_dim + value_dim + 2 * HV) + conv_dim * KC + DV + value_dim * H  # in_proj, conv, norm, out
    attn = H * (HQ * D * 2 + 2 * HKV * D) + 2 * D + HQ * D * H  # qkv (with gate), q/k norm, o_proj
    per_layer = 2 * H + H * (E + 1) + 3 * H * I_SHARED  # two norms, router + shared gate, shared expert
    bf16 = 3 * gdn + attn + 4 * per_layer + H + V * H  # + final norm + lm_head
    return 2 * bf16 + 4 * (3 * 2 * HV)  # A_log, dt_bias: f32 per GDN layer


def test_experts_touched_formula():
    assert experts_touched(8, 2, 0) == 0
    assert experts_touched(8, 2, 1) == pytest.approx(2)
    assert experts_touched(8, 2, 2) == pytest.approx(8 * (1 - 0.75 ** 2))  # 3.5
    assert experts_touched(256, 8, 128) == pytest.approx(256 * (1 - (1 - 8 / 256) ** 128))
    assert 7.99 < experts_touched(8, 2, 100) <= 8


@pytest.mark.parametrize("quantized", [False, True])
def test_model_bytes_hand_computed(quantized):
    cfg = small_config(quantized)
    model = build_model(cfg, torch.bfloat16, "meta", quant_plan(cfg))
    mb = ModelBytes.from_model(model)
    assert mb.nonexpert_weight_bytes == hand_nonexpert_bytes()
    assert mb.embed_row_bytes == 2 * H
    if quantized:  # NVFP4 (SPEC §2.1): packed codes K/2 B + E4M3 block scales K/16 B per row, f32 row scale
        w13 = 2 * I * (H // 2 + H // 16 + 4)
        w2 = H * (I // 2 + I // 16 + 4)
        assert mb.expert_bytes == w13 + w2
    else:
        assert mb.expert_bytes == 2 * 3 * H * I
    assert (mb.num_moe_layers, mb.num_experts, mb.top_k) == (4, E, TOPK)


def test_state_bytes_all_f32_vs_hybrid():
    cfg = small_config()
    model = build_model(cfg, torch.bfloat16, "meta")
    kv_per_token = PagedKVCache.bytes_per_block(cfg, 1, torch.bfloat16)
    assert kv_per_token == 1 * 2 * HKV * D * 2  # one attention layer, K and V, bf16
    conv = 3 * (KC - 1) * (2 * HK * DK + HV * DV) * 2
    f32 = ModelBytes.from_model(model, HybridStateCache(cfg, 3, torch.bfloat16, "meta"), kv_per_token)
    assert f32.ssm_state_bytes_per_seq == 3 * HV * DK * DV * 4
    assert f32.conv_state_bytes_per_seq == conv
    half = [[True, False, True, False]] * 3  # two heads of four in bf16 in every GDN layer
    hyb = ModelBytes.from_model(model, HybridStateCache(cfg, 3, torch.bfloat16, "meta", half), kv_per_token)
    assert hyb.ssm_state_bytes_per_seq == 3 * (2 * DK * DV * 4 + 2 * DK * DV * 2)
    B, L = 3, 10
    for mb in (f32, hyb):
        p = mb.step_bytes(B, L)
        assert p["weights"] == hand_nonexpert_bytes() + B * 2 * H
        assert p["experts"] == pytest.approx(experts_touched(E, TOPK, B) * 4 * 2 * 3 * H * I)
        assert p["state"] == 2 * B * mb.ssm_state_bytes_per_seq  # read + write
        assert p["conv"] == 2 * B * conv
        assert p["kv"] == B * L * kv_per_token
        assert p["total"] == pytest.approx(sum(p[k] for k in ("weights", "experts", "state", "conv", "kv")))
    assert f32.floor_ms(B, L, 1e12) > hyb.floor_ms(B, L, 1e12)


def test_floor_matches_bench_md_for_qwen35_35b_a3b():
    """BENCH.md: non-expert weights 3.9 GB incl. lm_head, f32 state 126 MB/seq/step, floor ms/step at
    4.28 TB/s and context 192: 1.07, 2.10, 4.58, 6.57, 9.04 (npl 1, 8, 32, 64, 128)."""
    cfg = ModelConfig.from_dict(PRESETS["qwen35moe-nvfp4"].hf_config())
    model = build_model(cfg, torch.bfloat16, "meta", quant_plan(cfg))
    mb = ModelBytes.from_model(model, HybridStateCache(cfg, 2, torch.bfloat16, "meta"),
                               PagedKVCache.bytes_per_block(cfg, 1, torch.bfloat16))
    assert mb.nonexpert_weight_bytes / 1e9 == pytest.approx(3.9, rel=0.01)
    assert 2 * mb.ssm_state_bytes_per_seq / 1e6 == pytest.approx(126, rel=0.01)
    for B, ms in zip([1, 8, 32, 64, 128], [1.07, 2.10, 4.58, 6.57, 9.04]):
        # ours also counts the per-row f32 scales of the stored experts (+0.7 % of expert bytes)
        assert mb.floor_ms(B, 192, 4.28e12) == pytest.approx(ms, rel=0.01)


def test_config_parsing():
    base = batched.BenchConfig("qwen35moe-nvfp4", "dummy")
    c = batched.parse_config("model=qwen35moe-bf16,ssm-bf16-tau=32,label=bf16 hybrid,enforce-eager", base)
    assert (c.model, c.load_format, c.ssm_bf16_tau, c.enforce_eager, c.label) == \
        ("qwen35moe-bf16", "dummy", 32.0, True, "bf16 hybrid")
    assert batched.parse_config("model=x", base).label == "x f32 state"
    with pytest.raises(ValueError, match="unknown key 'tau'"):
        batched.parse_config("model=x,tau=3", base)
    with pytest.raises(ValueError, match="needs a value"):
        batched.parse_config("model", base)


def test_vllm_ratio_only_for_its_shapes():
    row = {"PP": 128, "TG": 128, "B": 32, "S_TG": 6772.0}
    batched.add_peer(row, "nvfp4")
    assert row["vllm_S_TG"] == 3386 and row["vs_vllm"] == pytest.approx(2.0)
    row = {"PP": 64, "TG": 128, "B": 32, "S_TG": 6772.0}
    batched.add_peer(row, "nvfp4")
    assert row["vs_vllm"] is None


@pytest.fixture
def one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def test_bench_batched_tiny_cpu(tmp_path, monkeypatch, one_thread, capsys):
    """Two configurations (all-f32 state, all-bf16 state) of the tiny preset in one run, sharing the
    weights: complete tables, JSON, PNG, a profile."""
    monkeypatch.setenv("LINRNN_SERVE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    out = tmp_path / "out"
    from linrnn_serve.cli import main

    rc = main(["bench", "batched", "--model", "tiny", "--npp", "8", "--ntg", "4", "--npl", "1,3",
               "--ssm-bf16-tau", "inf,0", "--warmup-steps", "2", "--profile", "3", "--profile-steps", "2",
               "--vllm-ref", "--no-progress", "--out", str(out)])
    assert rc == 0
    report = json.loads((out / "batched.json").read_text())
    assert report["env"]["torch"] == torch.__version__ and report["env"]["date"] and "command" in report["env"]
    assert report["copy_bandwidth_Bps"] > 0
    f32, bf16 = report["configs"]
    assert f32["state_f32_fraction"] == 1.0 and bf16["state_f32_fraction"] == 0.0
    assert bf16["model_bytes"]["ssm_state_bytes_per_seq"] * 2 == f32["model_bytes"]["ssm_state_bytes_per_seq"]
    for res in (f32, bf16):
        assert [r["B"] for r in res["rows"]] == [1, 3]
        for r in res["rows"]:
            assert r["complete"] and r["decoded_tokens"] == r["B"] * 4
            assert r["N_KV"] == r["B"] * (8 + 4)
            assert r["S_TG"] == pytest.approx(r["B"] * 4 / r["T_TG"])
            assert r["S"] == pytest.approx(r["N_KV"] / (r["T_PP"] + r["T_TG"]))
            assert r["floor_ms"] > 0 and r["pct_floor"] == pytest.approx(100 * r["floor_ms"] / r["ms_per_step"])
            assert r["floor_context"] == 8 + 2 and r["vs_vllm"] is None  # not the vLLM shapes
    assert f32["profile"] == []  # profiles run after every timed row: with the last configuration
    (prof,) = bf16["profile"]
    assert prof["top"] and prof["B"] == 3 and prof["wall_ms_per_step"] > 0
    assert f32["rows"][1]["floor_bytes"]["state"] == 2 * bf16["rows"][1]["floor_bytes"]["state"]
    md = (out / "batched.md").read_text()
    for col in batched.COLUMNS + ["vs vLLM", "S_TG ratios"]:
        assert col in md
    assert (out / "batched.png").stat().st_size > 10_000
    printed = capsys.readouterr().out
    assert "engine ready" in printed and "| 8 | 4 | 3 | 36 |" in printed
    assert "reusing the loaded weights" in printed  # the second configuration shares the model
    assert f32["graph_buckets"] == bf16["graph_buckets"] == [1, 3]  # only the timed batch sizes


def test_bad_arguments_are_named(tmp_path):
    with pytest.raises(SystemExit, match="--max-num-seqs 2 is smaller than the largest --npl 4"):
        batched.main(["--model", "tiny", "--npl", "1,4", "--max-num-seqs", "2"])
    with pytest.raises(SystemExit, match="--npl must be a comma list"):
        batched.main(["--model", "tiny", "--npl", "1,x"])
    with pytest.raises(SystemExit, match="--max-model-len 16 is too small"):
        batched.main(["--model", "tiny", "--npp", "32", "--max-model-len", "16"])
    with pytest.raises(SystemExit, match="--baseline 'nope' is neither"):
        batched.main(["--model", "tiny", "--baseline", "nope"])
    with pytest.raises(SystemExit, match="unknown key"):
        batched.main(["--config", "model=tiny,bogus=1"])
    assert batched.prefill_steps_bound(128, 128, 16384) == 4  # one step prefills all 128 prompts


def test_config_parsing_parallel():
    base = batched.BenchConfig("tiny")
    c = batched.parse_config("model=tiny,tp=2,ep", base)
    assert (c.tp, c.ep, c.label) == (2, True, "tiny f32 state EP2")
    assert batched.parse_config("model=tiny,tp=2", base).weights_key != batched.parse_config("model=tiny,tp=2",
                                                                                               base).weights_key


def test_bench_batched_tensor_parallel_cpu(tmp_path, monkeypatch, one_thread):
    """-tp 2 on the CPU (gloo): the table says TP2 and the communication table counts one all-reduce
    per sublayer + the embedding's, and the lm_head's all-gather (4 layers: 10 per step)."""
    monkeypatch.setenv("LINRNN_SERVE_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "out"
    rc = batched.main(["--model", "tiny", "--npp", "8", "--ntg", "2", "--npl", "2", "--warmup-steps", "0",
                       "--tensor-parallel-size", "2", "--no-progress", "--out", str(out)])
    assert rc == 0
    (res,) = json.loads((out / "batched.json").read_text())["configs"]
    assert res["parallel"] == "TP2" and res["comm_backend"] == "gloo"
    (row,) = res["rows"]
    assert row["complete"] and row["comm_calls_per_step"] == 10 and row["comm_ms_per_step"] > 0
    assert row["comm_bytes_per_step"] == 2 * 128 * 4 * 9 + 2 * (8192 // 2) * 4  # 9 all-reduces + 1 all-gather
    assert "Communication per decode step" in (out / "batched.md").read_text()


def test_busy_time_counts_overlapping_kernels_once():
    """Under programmatic dependent launch a kernel starts inside its predecessor (and waits there): the
    GPU's busy time is the union of the intervals, not the sum of the durations."""
    from linrnn_bench.batched import covered_us

    assert covered_us([]) == 0
    assert covered_us([(0, 10), (20, 25)]) == 15                 # disjoint, idle gap not counted
    assert covered_us([(0, 10), (8, 12), (11, 15)]) == 15        # chained overlaps (PDL)
    assert covered_us([(5, 9), (0, 10), (2, 3)]) == 10           # nested, any order
    assert covered_us([(0, 4), (4, 6)]) == 6                      # touching


def test_host_gap_is_wall_minus_profiled_kernel_time():
    from linrnn_bench import batched

    res = {"rows": [{"B": 1, "ms_per_step": 4.4}, {"B": 128, "ms_per_step": 22.7}],
           "profile": [{"B": 128, "busy_ms_per_step": 19.4, "what": "kernel"}]}
    batched.add_host_gap(res)
    assert "host_gap_ms" not in res["rows"][0]  # not profiled at B = 1
    assert res["rows"][1]["host_gap_ms"] == pytest.approx(3.3) and res["rows"][1]["kernel_ms"] == 19.4
    cells = batched.row_cells({**res["rows"][1], "PP": 128, "TG": 128, "N_KV": 1, "T_PP": 1, "S_PP": 1, "T_TG": 1,
                               "S_TG": 1, "S": 1, "floor_ms": 1, "pct_floor": 1}, False)
    assert cells[batched.COLUMNS.index("host gap ms/step")] == "3.300"


def test_bench_batched_overlapped_vs_sync_cpu(tmp_path, monkeypatch, one_thread):
    """--config async-scheduling=false / =true side by side (tools/gpu_overlap.sh): both complete, same
    tokens decoded per row, labelled apart; a profile of the last configuration gives the earlier one of the
    same weights its kernel time too (here on the CPU: no kernel rows, so no host gap on either)."""
    monkeypatch.setenv("LINRNN_SERVE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    out = tmp_path / "out"
    from linrnn_serve.cli import main

    rc = main(["bench", "batched", "--npp", "8", "--ntg", "4", "--npl", "1,3", "--warmup-steps", "1",
               "--config", "model=tiny,async-scheduling=false", "--config", "model=tiny,async-scheduling=true",
               "--no-progress", "--out", str(out)])
    assert rc == 0
    sync, over = json.loads((out / "batched.json").read_text())["configs"]
    assert sync["label"].endswith(" sync") and over["label"].endswith(" overlapped")
    for res in (sync, over):
        assert [r["B"] for r in res["rows"]] == [1, 3]
        assert all(r["complete"] and r["decoded_tokens"] == r["B"] * 4 for r in res["rows"])
    rows = {"B": 3, "kernel_ms": 1.0}
    prof = [{"B": 3, "busy_ms_per_step": 1.0, "what": "kernel"}]
    res = {"rows": [dict(rows, ms_per_step=1.25)]}
    batched.add_host_gap(res, prof)
    assert res["rows"][0]["host_gap_ms"] == pytest.approx(0.25)
