"""The cost model against hand-computed values for Llama 3.1 8B on an H100."""

from __future__ import annotations

import json

import pytest

from kvtiers.core.errors import ConfigError
from kvtiers.costmodel import (
    MODELS,
    Compute,
    ModelSpec,
    TierLink,
    break_even_bandwidth,
    break_even_tokens,
    format_plan,
    load_model,
    make_compute,
    parse_bandwidth,
    parse_duration,
    parse_tier_link,
    plan,
    ttft_seconds,
)

LLAMA_8B = MODELS["llama-3.1-8b"]
# H100 dense BF16 peak 989.4 TFLOP/s at the default 50% utilisation.
H100_FLOPS = 989.4e12 * 0.5
# Hand-computed prefill FLOPs of 1,024 tokens, no cache:
#   weights   2 * 8,030,261,248 * 1,024            = 16,445,975,035,904
#   attention 2 * 32 layers * 32 heads * (128 + 128) * (1,024 * 1,025 / 2) = 275,146,342,400
FLOPS_1K = 16_445_975_035_904 + 275_146_342_400


@pytest.mark.parametrize(
    ("name", "bytes_per_token"),
    [
        ("llama-3.1-8b", 32 * 2 * 8 * 128 * 2),  # 131,072
        ("llama-3.1-70b", 80 * 2 * 8 * 128 * 2),  # 327,680
        ("qwen2.5-7b", 28 * 2 * 4 * 128 * 2),  # 57,344
        ("deepseek-v3", 61 * 1 * 1 * 576 * 2),  # 70,272: one 512 + 64 latent per layer
    ],
)
def test_kv_bytes_per_token(name, bytes_per_token):
    assert MODELS[name].bytes_per_token == bytes_per_token
    assert MODELS[name].layout(512).chunk_bytes == bytes_per_token * 512


def test_prefill_flops_by_hand():
    assert LLAMA_8B.prefill_flops(1024) == FLOPS_1K
    assert LLAMA_8B.prefill_flops(0) == 0
    # One token after 1,000 cached: weights plus attention over 1,001 keys.
    assert LLAMA_8B.prefill_flops(1, 1000) == 2 * 8_030_261_248 + 2 * 32 * 32 * 256 * 1001


def test_mla_attention_uses_qk_and_v_sizes():
    ds = MODELS["deepseek-v3"]
    attention = 2 * 61 * 128 * (192 + 128) * (4 * 5 / 2)
    assert ds.prefill_flops(4) == 2 * 37e9 * 4 + attention


@pytest.mark.parametrize(("cached", "new"), [(0, 512), (4096, 1000), (777, 1)])
def test_prefill_flops_add_up_along_the_prompt(cached, new):
    whole = LLAMA_8B.prefill_flops(cached + new)
    assert whole == pytest.approx(
        LLAMA_8B.prefill_flops(cached) + LLAMA_8B.prefill_flops(new, cached)
    )


def test_compute_from_preset_override_and_measurements():
    compute = make_compute(LLAMA_8B, "h100")
    assert compute.flops_per_s == H100_FLOPS
    assert compute.prefill_seconds(LLAMA_8B, 1024) == pytest.approx(FLOPS_1K / H100_FLOPS)
    assert make_compute(LLAMA_8B, "A100", mfu=1.0).flops_per_s == 312e12
    assert make_compute(LLAMA_8B, tflops=100, mfu=0.4).flops_per_s == pytest.approx(40e12)
    measured = make_compute(LLAMA_8B, measured=[(1024, 0.05), (1024, 0.1)])
    assert measured.flops_per_s == pytest.approx((FLOPS_1K / 0.05 + FLOPS_1K / 0.1) / 2)
    for bad in ({"gpu": "TPU"}, {"mfu": 0.0}, {"tflops": -1.0}, {"measured": [(0, 1.0)]}):
        with pytest.raises(ConfigError):
            make_compute(LLAMA_8B, **bad)  # type: ignore[arg-type]


def test_ttft_with_and_without_cache_by_hand():
    compute = Compute(1e15, "test")
    dram = TierLink("dram", 50e9, 20e-6)
    nvme = TierLink("nvme", 5e9, 100e-6)
    assert ttft_seconds(LLAMA_8B, compute, 2048) == LLAMA_8B.prefill_flops(2048) / 1e15
    got = ttft_seconds(LLAMA_8B, compute, 2048, [(dram, 1024), (nvme, 512)])
    load = (20e-6 + 1024 * 131_072 / 50e9) + (100e-6 + 512 * 131_072 / 5e9)
    assert got == pytest.approx(load + LLAMA_8B.prefill_flops(512, 1536) / 1e15)
    # A fully cached prompt still computes its last token; the cap cuts the slow tier first.
    full = ttft_seconds(LLAMA_8B, compute, 1024, [(dram, 512), (nvme, 512)])
    load = (20e-6 + 512 * 131_072 / 50e9) + (100e-6 + 511 * 131_072 / 5e9)
    assert full == pytest.approx(load + LLAMA_8B.prefill_flops(1, 1023) / 1e15)


def test_break_even_bandwidth_by_hand():
    compute = Compute(H100_FLOPS, "h100")
    recompute = FLOPS_1K / H100_FLOPS  # about 33.8 ms
    assert recompute == pytest.approx(0.03383, rel=1e-3)
    assert break_even_bandwidth(LLAMA_8B, compute, 1024) == pytest.approx(
        1024 * 131_072 / recompute
    )
    assert break_even_bandwidth(LLAMA_8B, compute, 1024, 0.01) == pytest.approx(
        1024 * 131_072 / (recompute - 0.01)
    )
    assert break_even_bandwidth(LLAMA_8B, compute, 1024, 1.0) == float("inf")


def test_break_even_tokens_is_the_first_length_that_pays():
    compute = Compute(H100_FLOPS, "h100")
    slow = TierLink("s3", 1.5e9, 20e-3)

    def pays(n: int) -> bool:
        return compute.prefill_seconds(LLAMA_8B, n) > slow.load_seconds(n * 131_072)

    n = break_even_tokens(LLAMA_8B, compute, slow)
    assert n is not None
    assert pays(n)
    assert not pays(n - 1)
    assert break_even_tokens(LLAMA_8B, compute, TierLink("dram", 50e9)) == 1
    assert break_even_tokens(LLAMA_8B, compute, TierLink("tape", 1e6, 60.0)) is None


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("50GB/s", 50e9),
        ("1.5 GB/s", 1.5e9),
        ("12GiB/s", 12 * 2**30),
        ("100Gbps", 12.5e9),
        ("400Gb/s", 50e9),
        ("800MB/s", 800e6),
    ],
)
def test_parse_bandwidth(text, value):
    assert parse_bandwidth(text) == pytest.approx(value)


@pytest.mark.parametrize("text", ["fast", "50GB", "-1GB/s", "0GB/s", "5 parsecs/s"])
def test_parse_bandwidth_rejects(text):
    with pytest.raises(ConfigError, match="bandwidth"):
        parse_bandwidth(text)


def test_parse_duration_and_tier_links():
    assert parse_duration("20us") == pytest.approx(20e-6)
    assert parse_duration("1.5ms") == pytest.approx(1.5e-3)
    assert parse_duration("2s") == 2.0
    with pytest.raises(ConfigError, match="duration"):
        parse_duration("soon")
    assert parse_tier_link("nvme:5GB/s:1ms") == TierLink("nvme", 5e9, 1e-3)
    assert parse_tier_link("s3") == TierLink("s3", 1.5e9, 20e-3)
    assert parse_tier_link("cxl:100GB/s").latency == 20e-6  # unknown names default as DRAM
    with pytest.raises(ConfigError, match="NAME"):
        parse_tier_link("a:1GB/s:1ms:extra")


def test_load_model_presets_and_files(tmp_path):
    assert load_model("Llama-3.1-8B") is LLAMA_8B
    spec = tmp_path / "m.toml"
    spec.write_text(
        '[model]\nname = "tiny"\nnum_params = 1000000\nnum_layers = 2\nnum_heads = 4\n'
        "head_size = 16\nnum_kv_heads = 2\nkv_head_size = 16\n"
    )
    tiny = load_model(str(spec))
    assert tiny == ModelSpec("tiny", 1_000_000, 2, 4, 16, 2, 16)
    assert tiny.bytes_per_token == 2 * 2 * 2 * 16 * 2
    with pytest.raises(ConfigError, match="neither a preset"):
        load_model("gpt-17")
    spec.write_text('name = "x"\nnum_params = 1\nwings = 2\n')
    with pytest.raises(ConfigError, match=r"model.wings: unknown key"):
        load_model(str(spec))
    spec.write_text('name = "x"\nnum_params = 1\nnum_layers = 0\n')
    with pytest.raises(ConfigError, match="model"):
        load_model(str(spec))


def test_hugging_face_config_estimates_llama_8b(tmp_path):
    # The published config.json of meta-llama/Llama-3.1-8B (the fields the estimate reads).
    config = {
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "vocab_size": 128256,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "max_position_embeddings": 131072,
    }
    path = tmp_path / "Llama-3.1-8B" / "config.json"
    path.parent.mkdir()
    path.write_text(json.dumps(config))
    model = load_model(str(path))
    assert model.num_params == LLAMA_8B.num_params
    assert model.bytes_per_token == LLAMA_8B.bytes_per_token
    assert model.name == "Llama-3.1-8B"
    path.write_text(json.dumps({**config, "kv_lora_rank": 512}))
    with pytest.raises(ConfigError, match="MLA and mixture-of-experts"):
        load_model(str(path))


def test_plan_reports_each_tier():
    compute = make_compute(LLAMA_8B, "H200")
    links = [TierLink("dram", 50e9, 20e-6), TierLink("s3", 1.5e9, 20e-3)]
    result = plan(LLAMA_8B, compute, links)
    dram, s3 = result.tiers
    recompute = compute.prefill_seconds(LLAMA_8B, 1024)
    assert dram.saved_per_1k == pytest.approx(recompute - (20e-6 + 1024 * 131_072 / 50e9))
    assert dram.break_even_bandwidth == pytest.approx(1024 * 131_072 / (recompute - 20e-6))
    assert s3.saved_per_1k < 0 < s3.saved_per_1k_deep + 1  # slow at the head of a prompt
    assert s3.saved_per_1k_deep > s3.saved_per_1k  # deeper tokens cost more to recompute
    assert [n for n, _ in result.prefill] == [1024, 8192, 32768, 131072]
    text = format_plan(result)
    assert "128.00 KiB" in text
    assert "s3" in text


# -- the docs' plan table, by hand ------------------------------------------------------


def test_the_docs_plan_for_llama_8b_on_an_h200_by_hand():
    # docs/replay.md, `kvtiers plan --model llama-3.1-8b --gpu H200 --tier dram:50GB/s
    # --tier nvme:5GB/s --tier s3:1.5GB/s`, recomputed from the documented formula alone.
    flops_per_s = 989.4e12 * 0.5

    def prefill(n, c=0):
        return (2 * 8_030_261_248 * n + 2 * 32 * 32 * 256 * (n * c + n * (n + 1) / 2)) / flops_per_s

    def load(tokens, bandwidth, latency):
        return latency + tokens * 131_072 / bandwidth

    links = [
        TierLink("dram", 50e9, 20e-6),
        TierLink("nvme", 5e9, 100e-6),
        TierLink("s3", 1.5e9, 20e-3),
    ]
    result = plan(LLAMA_8B, make_compute(LLAMA_8B, "H200"), links)
    assert [round(s, 4) for _, s in result.prefill] == [0.0338, 0.3015, 1.6328, 13.359]
    assert prefill(1024) == pytest.approx(0.0338005, rel=1e-5)
    for tier, (bw, lat), prompt, be_gbps, head_ms, deep_ms in zip(
        result.tiers,
        [(50e9, 20e-6), (5e9, 100e-6), (1.5e9, 20e-3)],
        [1, 16, 103_996],
        [3.97, 3.98, 9.73],
        [31.1, 6.9, -75.7],
        [65.5, 41.3, -41.2],
        strict=True,
    ):
        assert tier.break_even_tokens == prompt
        # The first length that pays, and the one before it does not.
        assert prefill(prompt) > load(prompt, bw, lat)
        assert prompt == 1 or prefill(prompt - 1) <= load(prompt - 1, bw, lat)
        assert tier.break_even_bandwidth / 1e9 == pytest.approx(be_gbps, abs=0.005)
        assert tier.break_even_bandwidth == pytest.approx(1024 * 131_072 / (prefill(1024) - lat))
        assert tier.saved_per_1k * 1e3 == pytest.approx(head_ms, abs=0.05)
        assert tier.saved_per_1k_deep * 1e3 == pytest.approx(deep_ms, abs=0.05)
        assert tier.saved_per_1k_deep == pytest.approx(
            prefill(1024, 31 * 1024) - load(1024, bw, lat)
        )


def test_deepseek_v3_claims_in_the_docs():
    # "For DeepSeek-V3 (MLA, 69 KiB per token ...) the break-even is ~0.45 GB/s and the same
    # object store pays from ~200 tokens."
    model = MODELS["deepseek-v3"]
    compute = make_compute(model, "H200")
    assert model.bytes_per_token == 70_272
    assert break_even_bandwidth(model, compute, 1024) / 1e9 == pytest.approx(0.454, abs=0.001)
    assert break_even_tokens(model, compute, TierLink("s3", 1.5e9, 20e-3)) == 193


# -- nonsense in, a ConfigError out ------------------------------------------------------

HUGE = 10**400  # an int past the largest float


@pytest.mark.parametrize(
    ("make", "match"),
    [
        (lambda: Compute("5e14", "x"), "compute"),
        (lambda: Compute(HUGE, "x"), "compute"),
        (lambda: Compute(True, "x"), "compute"),
        (lambda: Compute(0.5, "x"), "compute"),  # less than 1 FLOP/s: TTFTs overflow
        (lambda: TierLink("x", 0.5), "bandwidth"),  # less than 1 B/s: loads overflow
        (lambda: TierLink("x", 5e-324), "bandwidth"),
        (lambda: TierLink("x", 1e9, 86_401), "latency"),
        (lambda: TierLink("x", 1e9, 1e308), "latency"),
        (lambda: make_compute(LLAMA_8B, 5), "gpu"),
        (lambda: make_compute(LLAMA_8B, None), "gpu"),
        (lambda: make_compute(LLAMA_8B, mfu="0.5"), "mfu"),
        (lambda: make_compute(LLAMA_8B, mfu=True), "mfu"),
        (lambda: make_compute(LLAMA_8B, mfu=HUGE), "mfu"),
        (lambda: make_compute(LLAMA_8B, tflops="5"), "tflops"),
        (lambda: make_compute(LLAMA_8B, tflops=True), "tflops"),
        (lambda: make_compute(LLAMA_8B, tflops=HUGE), "tflops"),
        (lambda: make_compute(LLAMA_8B, tflops=1e-300), "tflops"),
        (lambda: make_compute(LLAMA_8B, measured=[(1024, "1")]), "measured"),
        (lambda: make_compute(LLAMA_8B, measured=[(1024, HUGE)]), "measured"),
        (lambda: make_compute(LLAMA_8B, measured=[(1024, True)]), "measured"),
        (lambda: make_compute(LLAMA_8B, measured=[(True, 1.0)]), "measured"),
        (lambda: make_compute(LLAMA_8B, measured=[(1024,)]), "measured"),
        (lambda: make_compute(LLAMA_8B, measured=[1024]), "measured"),
        (lambda: make_compute(LLAMA_8B, measured=[(1, 1e300)]), "measured"),  # 0 FLOP/s
        (lambda: parse_bandwidth(5), "bandwidth"),
        (lambda: parse_bandwidth(None), "bandwidth"),
        (lambda: parse_bandwidth("５GB/s"), "bandwidth"),  # full-width digit
        (lambda: parse_bandwidth("0.5B/s"), "bandwidth"),
        (lambda: parse_duration(3), "latency"),
        (lambda: parse_duration("٣ms"), "latency"),  # an Arabic-Indic digit
        (lambda: parse_duration("2d"), "latency"),
        (lambda: parse_tier_link(5), "--tier"),
        (lambda: parse_tier_link("x:1GB/s:86401s"), "--tier x: .* longer than a day"),
        (lambda: ModelSpec("x", 1, 1, 1, 1, 2, 1, kind="mla"), "model.num_kv_heads"),
        (lambda: ModelSpec("x", 1, 2**31 - 1, 1, 1, 2**31 - 1, 2**31 - 1), "model"),
        (lambda: load_model(5), "model"),
        (lambda: load_model(None), "model"),
    ],
)
def test_nonsense_is_a_config_error(make, match):
    with pytest.raises(ConfigError, match=match):
        make()


@pytest.mark.parametrize(
    ("make", "value"),
    [
        (lambda: Compute(1, "x").flops_per_s, 1),  # an int is a number too
        (lambda: TierLink("x", 1).bandwidth, 1),
        (lambda: TierLink("x", 1e9, 86_400).latency, 86_400),
        (lambda: parse_bandwidth("1B/s"), 1.0),
        (lambda: parse_bandwidth("8bps"), 1.0),
        (lambda: parse_duration("0s"), 0.0),
        (lambda: parse_duration("1440 s"), 1440.0),
        (lambda: make_compute(LLAMA_8B, mfu=1).flops_per_s, 989.4e12),
        (lambda: make_compute(LLAMA_8B, "h200").flops_per_s, 989.4e12 * 0.5),
    ],
)
def test_edges_that_are_kept(make, value):
    assert make() == pytest.approx(value)


def test_every_figure_of_a_plan_is_finite_at_the_bounds():
    import math

    model = ModelSpec("big", 2**53, 2**20, 2**20, 2**20, 2**10, 2**10, max_context=2**31 - 1)
    compute = Compute(1.0, "one FLOP/s")
    result = plan(model, compute, [TierLink("slow", 1.0, 86_400.0), TierLink("fast", 1e15)])
    figures = [s for _, s in result.prefill]
    for t in result.tiers:
        figures += [t.saved_per_1k, t.saved_per_1k_deep]
        assert t.break_even_bandwidth == math.inf or math.isfinite(t.break_even_bandwidth)
    assert all(math.isfinite(x) for x in figures)
    ttft = ttft_seconds(model, compute, 2**31 - 1, [(result.tiers[0].link, 2**30)] * 4)
    assert math.isfinite(ttft)
