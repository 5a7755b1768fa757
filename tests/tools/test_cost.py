"""tools/cost.py and the benchmark commands: the JSON and text reports against the hand numbers and
lab/counting.py, the crossovers as printed, one-line errors through the real CLI, a hybrid stack's report,
and tools/bench_attention.py and the bench's layer kinds measured side by side."""
import dataclasses
import json
import math
from fractions import Fraction

import pytest

from rules import UserError
from lab.config import model_config
from lab.counting import attention_variants, crossovers, per_gpu_bytes
from tools.cost import cost, round_half_up
from helpers import GQA_SWIGLU, MHA_GELU, compose_cfg
from model import GPT, GPTConfig


def cost_cfg(*overrides, tmp_path=None):
    plot = f"plot={tmp_path / 'cost.png'}" if tmp_path else "plot=null"
    return compose_cfg("cost", [plot, *overrides])


def model_overrides(fields):
    return [f"model.{k}={v}" for k, v in fields.items()]


def test_json_output_has_the_issue_keys_and_the_hand_numbers(capsys, tmp_path):
    cfg = cost_cfg("model=debug", *model_overrides(GQA_SWIGLU), "seq_len=32", "batch_size=2", "dtype=bfloat16",
                   "format=json", tmp_path=tmp_path)
    result = cost(cfg)
    printed = json.loads(capsys.readouterr().out)  # one JSON object, nothing else on stdout
    assert printed == result
    variants = attention_variants(GPTConfig(**GQA_SWIGLU), 32, 2, 2)
    assert result.pop("attention_variants") == json.loads(json.dumps(variants))
    table = {(r["kind"].split()[0], r["dtype"]): r for r in result.pop("kv_cache_table")}
    # GQA_SWIGLU: 2 layers, 4 heads of 20, 2 K/V heads: per token 2 (k, v) x 2 layers x heads x 20 numbers
    assert table[("MHA", "bfloat16")]["per_token"] == 2 * 2 * 4 * 20 * 2
    assert table[("GQA", "float32")]["per_token"] == 2 * 2 * 2 * 20 * 4
    assert table[("MQA", "int8")]["per_token"] == 2 * 2 * 1 * (20 + 4)  # a byte a number, an fp32 scale per head
    assert table[("MLA", "bfloat16")]["per_token"] == 2 * (4 * 20 + 20 // 2) * 2  # latent 4 hs + RoPE key hs/2
    assert table[("GQA", "bfloat16")]["131072"] == 131072 * 2 * 2 * 2 * 20 * 2 * 2  # x tokens x batch 2
    # per layer: q, o 80 x 80 and k, v 80 x 40 weights; q.k and the weighted sum 2 x 32 keys x 80; the
    # cache 2 (k, v) x 2 K/V heads x 20 numbers x 2 bytes for 32 tokens of 2 sequences
    assert result.pop("layers") == [{"kind": "softmax", "params": 19200, "mixer_macs": 19200 + 2 * 32 * 80,
                                     "mlp_params": 61440, "cache_bytes": 2 * 2 * 20 * 2 * 32 * 2, "state_bytes": 0,
                                     "layers": 2}]
    per_gpu = result.pop("memory_per_gpu")  # counting.per_gpu_bytes, checked by hand in test_counting.py
    assert list(per_gpu) == ["one_gpu", "ddp", "fsdp"] and list(per_gpu["ddp"]) == ["plain", "checkpointed"]
    assert per_gpu["fsdp"]["plain"] == per_gpu_bytes(GPTConfig(**GQA_SWIGLU), 2, 32, 8, "fsdp", 2)
    assert result == {
        "params": 177680,
        "macs_per_token": {"proj": 19200, "attn": 5120, "mlp": 61440, "lm_head": 8000},
        "crossover": {"attn_vs_proj": 120, "attn_vs_mlp": 384, "attn_vs_proj_mlp": 504},
        "memory_bytes": {"weights": 355360, "adamw_state": 1421440, "attn_weights_per_layer": 16384,
                         "attn_weights_all_layers": 32768, "kv_cache_per_token": 320, "kv_cache": 20480,
                         "kv_cache_mha": 40960}}
    assert (tmp_path / "cost.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_text_report_names_units_and_conventions(capsys):
    cost(cost_cfg("model=debug", *model_overrides(MHA_GELU), "seq_len=32", "dtype=float32"))
    out = capsys.readouterr().out
    for phrase in ("1 MAC = 2 FLOPs", "113,216 MACs = 226,432 FLOPs per token", "679,296 FLOPs per token",
                   "counting.flops_per_token(32)", "full N x N table", "about half", "N = d + d_kv", "128 tokens",
                   "256 tokens", "384 tokens", "float32 (4 bytes per number)", "(420,096 B)", "105,024",
                   "KV cache with MHA", "training memory per GPU", "DDP x 8", "FSDP x 8",
                   "total with activation checkpointing"):
        assert phrase in out, phrase
    assert "GQA:" not in out  # MHA: no saving to report


# ----------------------------------------------------------------------------- crossovers

def test_crossovers_round_to_the_nearest_integer(capsys):
    # SwiGLU with d_ff=101: 3*101/2 = 151.5 (exact), reported as 152; + d + d_kv = 80 + 40 -> 271.5 -> 272
    c = GPTConfig(**{**GQA_SWIGLU, "d_ff": 101})
    assert crossovers(c)["attn_vs_mlp"] == Fraction(303, 2)
    assert round_half_up(Fraction(303, 2)) == 152 and round_half_up(Fraction(7, 3)) == 2
    result = cost(cost_cfg("model=debug", *model_overrides(GQA_SWIGLU), "model.d_ff=101", "format=json"))
    assert result["crossover"] == {"attn_vs_proj": 120, "attn_vs_mlp": 152, "attn_vs_proj_mlp": 272}


# ----------------------------------------------------------------------------- errors

@pytest.mark.parametrize("override, message", [
    ("seq_len=0", "seq_len=0 must be an integer >= 1"),
    ("seq_len=-8", "seq_len=-8 must be an integer >= 1"),
    ("batch_size=0", "batch_size=0 must be an integer >= 1"),
    ("dtype=fp8", "dtype='fp8' is unknown"),
    ("format=yaml", "format='yaml' is unknown"),
    ("world_size=0", "world_size=0 must be"),
    ("model.n_kv_head=3", "model.n_kv_head=3 must divide model.n_head=2"),
    ("model.n_embd=33", "model.n_embd=33 is not divisible"),
])
def test_bad_values_are_user_errors(override, message):
    with pytest.raises(UserError, match=message.replace("(", r"\(").replace(")", r"\)")):
        cost(cost_cfg("model=debug", override))


def test_cli_prints_one_line_errors(tmp_path, cli):
    r = cli("tools/cost.py", "model=debug", "model.n_kv_head=3", cwd=tmp_path)
    assert r.returncode == 1 and r.stdout == ""
    assert r.stderr.startswith("error: model.n_kv_head=3 must divide model.n_head=2") and r.stderr.count("\n") == 1
    assert list(tmp_path.iterdir()) == []  # refused before the plot


def test_cli_llama3_8b_json(tmp_path, cli):
    """The README's command, in JSON, through the real CLI; the figure lands in a new outputs/cost/<time>/ under
    the working directory, named on stderr (stdout is the JSON alone)."""
    r = cli("tools/cost.py", "model=llama3_8b_shape", "seq_len=8192", "format=json", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["params"] == 8_030_261_248
    assert out["macs_per_token"] == {"proj": 41_943_040, "attn": 67_108_864, "mlp": 176_160_768,
                                     "lm_head": 525_336_576}
    assert out["memory_bytes"]["attn_weights_per_layer"] == 32 * 8192**2 * 2  # 4 GiB for one layer
    (png,) = (tmp_path / "outputs" / "cost").glob("*/cost.png")
    assert f"wrote {png.relative_to(tmp_path)}" in r.stderr


# ----------------------------------------------------------------------------- the N² wall: each attention kind's report and benchmarks

def test_cost_prints_the_four_ways(tmp_path, capsys):
    out = cost(compose_cfg("cost", ["model=cpu_small", "seq_len=4096", "plot=null"]))
    text = capsys.readouterr().out
    for name in ("reference (full table)", "tiled (FlashAttention)", "window W=512", "linear (elu + 1)"):
        assert name in text
    assert [r["name"] for r in out["attention_variants"]][1] == "tiled (FlashAttention)"
    assert math.isclose(out["attention_variants"][0]["memory"] / out["attention_variants"][1]["memory"], 4096 / 33,
                        rel_tol=1e-9)


def test_bench_attention_measures_each_path_against_its_own_prediction(tmp_path):
    """tools/bench_attention.py at two lengths: what the reference keeps for its backward grows ~4x when N
    doubles (the table), the tiled paths' ~2x (no table); each row's predicted MACs are counting's for
    that path's own config (the window path's W, not a default), and the plot is written."""
    from tools.bench_attention import bench_attention
    cfg = compose_cfg("bench_attention", ["lengths=[512,1024]", "repeats=1", "window=32", "block=64",
                                          f"out={tmp_path / 'n2.png'}"])
    rows = {(r["path"], r["N"]): r for r in bench_attention(cfg)["rows"]}
    assert {p for p, _ in rows} == {"sdpa", "reference", "tiled", "window", "tiled_window", "linear"}
    grow = {p: rows[(p, 1024)]["saved_bytes"] / rows[(p, 512)]["saved_bytes"] for p, _ in rows}
    assert 3.0 < grow["reference"] < 4.2, grow  # the table, plus the O(N) projections it also keeps
    assert grow["tiled"] < 2.3 and grow["tiled_window"] < 2.3, grow
    d = cfg.n_embd
    assert rows[("window", 1024)]["predicted_macs_per_token"] == 2 * 32 * d
    assert rows[("tiled_window", 1024)]["predicted_macs_per_token"] == 2 * 32 * d
    assert rows[("tiled", 1024)]["predicted_macs_per_token"] == rows[("reference", 1024)]["predicted_macs_per_token"] \
        == 2 * 1024 * d
    assert all(r["ms"] > 0 for r in rows.values())
    assert (tmp_path / "n2.png").read_bytes()[:4] == b"\x89PNG"


def test_bench_attention_decodes_each_recurrent_path_from_a_state_that_does_not_grow():
    """decode=true: sdpa's cache holds N + 1 keys and values (the context and the new token), gdn's and
    mamba2's state the same bytes at every N; each ratio is the median of the rounds' ratios to sdpa
    timed beside it, and the crossover is the first N from which the path stays below sdpa."""
    import statistics
    from tools.bench_attention import bench_attention
    d = 64
    result = bench_attention(compose_cfg("bench_attention", ["lengths=[32,64]", "paths=[sdpa,gdn,mamba2]", "decode=true",
                                                            f"n_embd={d}", "n_head=2", "repeats=2", "out=null"]))
    rows = {(r["path"], r["N"]): r for r in result["rows"]}
    for N in (32, 64):
        assert rows[("sdpa", N)]["cache_bytes"] == 2 * (N + 1) * d * 4
        for path in ("gdn", "mamba2"):
            row, base = rows[(path, N)], rows[("sdpa", N)]
            assert row["vs_sdpa"] == statistics.median(a / b for a, b in zip(row["seconds"], base["seconds"]))
            assert row["decode_vs_sdpa"] == statistics.median(
                a / b for a, b in zip(row["decode_seconds"], base["decode_seconds"]))
            assert row["decode_ms"] > 0
    for path in ("gdn", "mamba2"):
        assert rows[(path, 32)]["cache_bytes"] == rows[(path, 64)]["cache_bytes"] > 0
        below = [rows[(path, N)]["vs_sdpa"] < 1 for N in (32, 64)]
        assert result["crossover"][path] == (32 if all(below) else 64 if below[1] else None)


def test_bench_attention_decode_needs_sdpa_to_compare_with():
    from tools.bench_attention import bench_attention
    with pytest.raises(UserError, match="sdpa"):
        bench_attention(compose_cfg("bench_attention", ["lengths=[32]", "paths=[gdn]", "decode=true", "out=null"]))


def test_bench_times_other_layer_kinds_of_the_same_model_side_by_side(capsys):
    """bench.kinds: each pattern is the configured model with those layer kinds (its parameters are that
    model's), timed in the same rounds; its ratio is its median step time over the configured one's."""
    from tools.bench import bench, print_result
    cfg = compose_cfg("bench", ["model=debug", "device=cpu", "bench.iters=1", "bench.warmup=0", "bench.rounds=2",
                                "bench.kinds=[gdn,mamba2+softmax]", "train.batch_size=2"])
    r = bench(cfg)
    for pattern, kinds in (("gdn", ["gdn"]), ("mamba2+softmax", ["mamba2", "softmax"])):
        c = model_config(cfg.model, cfg.bench.vocab_size)
        built = GPT(GPTConfig(**{**dataclasses.asdict(c), "attn": {**dataclasses.asdict(c.attn), "layer_kinds": kinds}}))
        assert r[pattern]["params"] == built.num_params() != r["params"]
        assert r[pattern]["time_ratio"] == r[pattern]["ms_per_iter"] / r["attnlab"]["ms_per_iter"]
        assert len(r[pattern]["round_ratios"]) == 2
    print_result(r)
    assert "mamba2+softmax:" in capsys.readouterr().out


# ----------------------------------------------------------------------------- hybrid stacks

def test_a_qwen3_next_like_stack_at_262144_tokens_against_all_attention(capsys):
    """model=qwen3_next_shape (48 layers, 3 gdn : 1 attention) at 256K tokens: the KV cache and the
    states cost.py reports, written out from the shape, against the same stack all attention, and the
    layer table's counts equal the built layers' (one of each kind, at the same width)."""
    out = cost(compose_cfg("cost", ["model=qwen3_next_shape", "seq_len=262144", "plot=null"]))
    N, hs = 262144, 2048 // 16
    this, full = out["all_attention"]["this"], out["all_attention"]["all_attention"]
    assert full["kv_cache_bytes"] == 48 * 2 * 2 * hs * 2 * N and this["kv_cache_bytes"] == 12 * 2 * 2 * hs * 2 * N
    assert this["state_bytes"] == 36 * (16 * hs * hs + 3 * 2048 * 3) * 4 and full["state_bytes"] == 0
    assert [(r["kind"], r["layers"]) for r in out["layers"]] == [("gdn", 36), ("softmax", 12)]
    assert "cache + states" in capsys.readouterr().out
    c = model_config(compose_cfg("cost", ["model=qwen3_next_shape"]).model)
    small = GPT(dataclasses.replace(c, n_layer=2, vocab_size=8, block_size=8,
                                    attn=dataclasses.replace(c.attn, layer_kinds=["gdn", "softmax"])))
    assert [r["params"] for r in out["layers"]] == \
        [sum(p.numel() for p in b.attn.parameters()) for b in small.blocks]


def test_cost_says_what_a_selecting_query_reads(capsys):
    """model.attn.select: the mean keys a query reads at N, as counting.selected_keys gives them for the
    config and for its causal table ((N + 1) / 2)."""
    from lab.counting import selected_keys
    cfg = compose_cfg("cost", ["model=debug", "model.vocab_size=50", "seq_len=256", "format=json", "plot=null",
                               "model.attn.select=moba", "model.attn.select_block=16", "model.attn.select_topk=3"])
    cost(cfg)
    out = json.loads(capsys.readouterr().out)["selected_keys_per_query"]
    c = model_config(cfg.model, 50)
    assert out == {"selected": float(selected_keys(c, 256)), "causal": 257 / 2}
    assert out["selected"] == (sum(i % 16 + 1 + min(3, i // 16) * 16 for i in range(256))) / 256
