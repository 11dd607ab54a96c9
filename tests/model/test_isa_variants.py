"""The ISA variants of the CPU kernels (serve/model/kernels/isa.py): each variant this machine executes computes
what float64 computes and what the other variants compute, keeps the row-alone contract, and the probe that picks
a variant runs it in a child process, so a variant the CPU cannot execute (here one whose probe is ``ud2``) is
refused without the test process dying."""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

import pytest
import torch

from serve.model import kernels
from serve.model.kernels import isa
from serve.model.linear import BlockedLayout
from serve.model.quantized_linear.int4_packing import pack_int4_blocked
from tests.model.test_kv_mixed_decode import BS, _f64_attention, _mixed_cache, _tables
from tests.model.test_qkernels import _check_close, _gen, _q8_round_trip

torch.set_num_threads(2)

USABLE = [name for name in isa.VARIANTS if kernels.cpu_supported() and kernels.variant_ops(name) is not None]

# A variant no x86 CPU executes: its probe is the undefined instruction (SIGILL in whatever process runs it).
PLANT_SOURCE = """
#include <pybind11/pybind11.h>
#include <cstdint>
int64_t probe() { __asm__ volatile("ud2"); return 0; }
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("probe", &probe); }
"""


def test_the_baseline_is_usable_and_avx512_where_the_cpu_lists_it() -> None:
    """The machines CI and development run on have AVX2 + gcc; where the CPU lists AVX-512 F/BW/VL/VNNI the
    AVX-512 variant must build and pass its probe, not fall back unnoticed."""
    assert kernels.cpu_supported(), "CI and this project's machines have AVX2"
    assert "avx2" in USABLE
    if set(isa.AVX512.requires) <= isa.cpu_flags():
        assert "avx512" in USABLE
        assert kernels.variant_ops("avx512").fp32_blocked_linear.__module__ == isa.AVX512.module


def _blocked(x: torch.Tensor, w: torch.Tensor, block: int, bias: torch.Tensor | None, name: str) -> torch.Tensor:
    n, k = w.shape
    packed = BlockedLayout(n, k, block, torch.empty(0, dtype=torch.uint8)).pack(w)
    return kernels.variant_ops(name).fp32_blocked_linear(x, packed, n, block, bias)


@pytest.mark.parametrize("n,block", [(48, 16), (96, 32), (960, 64)])
@pytest.mark.parametrize("k", [13, 576])
@pytest.mark.parametrize("m", [1, 3, 49])
def test_blocked_linear_of_every_variant_matches_float64_and_equals_the_others(n: int, block: int, k: int,
                                                                              m: int) -> None:
    """Each output is one fp32 FMA chain over k in order (whatever the vector width), so the variants agree bit for
    bit, and each is within fp32 summation error of float64."""
    g = _gen(n + 7 * k + m)
    x, w, bias = torch.randn(m, k, generator=g), torch.randn(n, k, generator=g), torch.randn(n, generator=g)
    outs = {name: _blocked(x, w, block, bias, name) for name in USABLE}
    for y in outs.values():
        _check_close(y, x, w, bias)
    first = next(iter(outs.values()))
    assert [name for name, y in outs.items() if not torch.equal(y, first)] == []


@pytest.mark.parametrize("n,k,group", [(40, 64, 32), (200, 576, 64), (64, 256, 128), (96, 1536, 128), (16, 512, 256)])
@pytest.mark.parametrize("m", [1, 2, 5])
def test_int8_activation_kernels_of_every_variant_match_float64_and_equal_the_others(n: int, k: int, group: int,
                                                                                    m: int) -> None:
    """The integer dot products are exact on both variants (vpmaddubsw + vpmaddwd, VNNI's vpdpbusd: the same int32
    lanes) and the fp32 scaling that follows is the same code, so the variants agree bit for bit; each is within
    the fp32 bound of float64 on the rounded activations (the reference of tests/model/test_qkernels.py)."""
    g = _gen(n * 3 + k + m)
    x = torch.randn(m, k, generator=g)
    xr = _q8_round_trip(x)
    q8 = torch.randint(-128, 128, (n, k), generator=g, dtype=torch.int8)
    sc = (torch.rand(n, generator=g) * 0.01 + 1e-4).bfloat16()
    codes = torch.randint(0, 16, (n, k), generator=g, dtype=torch.int32)
    sz = torch.stack([torch.rand(k // group, n, generator=g) * 0.02 + 1e-3,
                      torch.randn(k // group, n, generator=g) * 0.01], dim=-1).bfloat16().contiguous()
    s, z = (t.float().t().repeat_interleave(group, dim=1) for t in (sz[..., 0], sz[..., 1]))
    packed = pack_int4_blocked(codes)
    outs8 = {name: kernels.variant_ops(name).int8_linear_q8(x, q8, sc) for name in USABLE}
    outs4 = {name: kernels.variant_ops(name).int4_linear_q8(x, packed, sz, group) for name in USABLE}
    for name in USABLE:
        _check_close(outs8[name], xr, q8.float() * sc.float()[:, None])
        _check_close(outs4[name] - x @ z.t(), xr, (codes.float() - 8) * s)  # zero points: the exact fp32 sum of x
    for outs in (outs8, outs4):
        first = next(iter(outs.values()))
        assert [name for name, y in outs.items() if not torch.equal(y, first)] == []


@pytest.mark.parametrize(("group", "kvh", "hd"), [(3, 3, 64), (4, 2, 72), (2, 2, 32), (1, 1, 48)])
@pytest.mark.parametrize("formats", ["full", "q8", "mixed"])
def test_decode_attention_of_every_variant_matches_float64_and_equals_the_others(group: int, kvh: int, hd: int,
                                                                                formats: str) -> None:
    """fp32, 8-bit and mixed KV tables: each output lane of P.V is one FMA chain over the tokens whatever the vector
    width (16 lanes on AVX-512 where the head dimension allows, 8 otherwise: 72), so the variants agree bit for bit;
    each is within the kernels' bound of float64 attention over the blocks as the dense path reads them."""
    lens = [1, 17, 40, 64, 5]
    g = _gen(group * 100 + kvh * 10 + hd + len(formats))
    nb = max(-(-n // BS) for n in lens)
    kv, full, q8 = _mixed_cache(kvh, hd, 4 * len(lens) * nb + 4, g)
    tables = _tables(lens, full, q8, g, formats)
    blocks, fmts = kv.block_map[tables], kv.block_format[tables]
    index = kv.decode_index(blocks, fmts)
    assert index[0] == {"full": "full", "q8": "q8", "mixed": "mixed"}[formats]
    q, lens_t = torch.randn(len(lens), kvh * group * hd, generator=g), torch.tensor(lens)
    outs = {name: kv.paged_decode(kernels.variant_ops(name), q, index, 1, lens_t, 0.125) for name in USABLE}
    kd, vd = kv.read_blocks(1, blocks, fmts)
    for name, y in outs.items():
        for b, n in enumerate(lens):
            ref = _f64_attention(q[b], kd[b, :n], vd[b, :n], group, 0.125)
            assert torch.allclose(y[b].double(), ref, atol=1e-5, rtol=1e-5), (name, b)
    first = next(iter(outs.values()))
    assert [name for name, y in outs.items() if not torch.equal(y, first)] == []


@pytest.mark.parametrize("name", USABLE)
@pytest.mark.parametrize("m", [5, 21, 50])
def test_each_variant_computes_each_row_as_if_alone(name: str, m: int) -> None:
    """The row-alone contract (speculation's greedy equality) on every variant: rows computed together equal each
    row computed alone, bit for bit, for every op a decode or verify step runs on that variant's code."""
    ops = kernels.variant_ops(name)
    n, k, group, block = 192, 576, 64, 64
    g = _gen(m * 11 + 5)
    x = torch.randn(m, k, generator=g)
    w = torch.randn(n, k, generator=g)
    packed = BlockedLayout(n, k, block, torch.empty(0, dtype=torch.uint8)).pack(w)
    bias = torch.randn(n, generator=g)
    q8 = torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8)
    sc = (torch.rand(n, generator=g) * 0.01 + 1e-4).bfloat16()
    sz = torch.stack([torch.rand(k // group, n, generator=g) * 0.02 + 1e-3,
                      torch.randn(k // group, n, generator=g) * 0.01], dim=-1).bfloat16().contiguous()
    int4 = pack_int4_blocked(torch.randint(0, 16, (n, k), generator=g, dtype=torch.int32))
    calls = {"fp32_blocked_linear": lambda x: ops.fp32_blocked_linear(x, packed, n, block, bias),
             "int8_linear_q8": lambda x: ops.int8_linear_q8(x, q8, sc),
             "int4_linear_q8": lambda x: ops.int4_linear_q8(x, int4, sz, group)}
    differ = [op for op, fn in calls.items()
              if not torch.equal(fn(x), torch.cat([fn(x[i:i + 1].contiguous()) for i in range(m)]))]
    assert differ == [], (name, differ)


# ------------------------------------------------------------------------------------------------ the probe


@pytest.fixture(scope="module")
def plant(tmp_path_factory) -> isa.Variant:
    source = tmp_path_factory.mktemp("plant") / "isa_plant_ud2.cpp"
    source.write_text(PLANT_SOURCE)
    return isa.Variant(name="ud2", module="morphserve_isa_plant_ud2", sources=(str(source),), headers=(),
                       cflags=("-O1",), checksum=0, requires=())


@pytest.fixture
def fresh(monkeypatch, tmp_path: Path):
    """A process state with no choice made yet and the probe's verdicts in a file of this test's own."""
    monkeypatch.setattr(kernels, "_state", {})
    monkeypatch.setattr(isa, "PROBE_FILE", str(tmp_path / "isa_probe.json"))
    monkeypatch.delenv("MORPHSERVE_QKERNELS", raising=False)
    monkeypatch.delenv("MORPHSERVE_CPU_ISA", raising=False)
    return tmp_path / "isa_probe.json"


def test_probe_of_a_variant_the_cpu_cannot_execute_reports_sigill_and_caches_it(plant, fresh, monkeypatch) -> None:
    usable, why = isa.probe(plant, kernels.build_dir(plant).name, kernels.cache_dir())
    assert not usable and "SIGILL" in why, why
    assert '"usable": false' in fresh.read_text()

    def no_child(variant: isa.Variant) -> tuple[bool, str, bool]:
        raise AssertionError("a cached verdict must not start a child")

    monkeypatch.setattr(isa, "_run_child", no_child)
    assert isa.probe(plant, kernels.build_dir(plant).name, kernels.cache_dir()) == (False, why)


def test_probe_of_the_real_variants_executes_them_in_a_child(fresh) -> None:
    for name in USABLE:
        variant = isa.VARIANTS[name]
        assert isa.probe(variant, kernels.build_dir(variant).name, kernels.cache_dir()) == \
            (True, "executed in a child process")


def test_a_wrong_checksum_is_not_usable(fresh) -> None:
    wrong = dataclasses.replace(isa.AVX2, checksum=isa.AVX2.checksum + 1)
    usable, why = isa.probe(wrong, kernels.build_dir(wrong).name, kernels.cache_dir())
    assert not usable and f"computed {isa.AVX2.checksum}" in why


def test_a_planted_unusable_first_choice_falls_back_with_a_warning(plant, fresh, monkeypatch, caplog) -> None:
    """The plant is preferred over every real variant: ``auto`` must probe it, log why it is skipped and serve on
    the next usable variant, in this process, which is still alive to check it."""
    monkeypatch.setitem(isa.VARIANTS, plant.name, plant)
    monkeypatch.setattr(isa, "PREFERENCE", [plant.name, *isa.PREFERENCE])
    with caplog.at_level(logging.WARNING, logger=kernels.__name__):
        ops = kernels.ops()
    assert ops is not None
    assert kernels.isa_name() == [n for n in isa.PREFERENCE if n in USABLE][0]
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "ud2 variant is not usable" in warnings[0] and "SIGILL" in warnings[0], warnings
    x = torch.randn(2, 64)
    w = torch.randn(32, 64)
    packed = BlockedLayout(32, 64, 16, torch.empty(0, dtype=torch.uint8)).pack(w)
    _check_close(ops.fp32_blocked_linear(x, packed, 32, 16, None), x, w, None)


def test_a_forced_variant_the_cpu_cannot_execute_is_refused(plant, fresh, monkeypatch) -> None:
    monkeypatch.setitem(isa.VARIANTS, plant.name, plant)
    monkeypatch.setenv("MORPHSERVE_CPU_ISA", plant.name)
    with pytest.raises(RuntimeError, match=r"MORPHSERVE_CPU_ISA=ud2: .*SIGILL"):
        kernels.ops()


@pytest.mark.parametrize("name", USABLE)
def test_a_forced_usable_variant_is_the_one_that_runs(name: str, fresh, monkeypatch) -> None:
    monkeypatch.setenv("MORPHSERVE_CPU_ISA", name)
    assert kernels.ops() is not None and kernels.isa_name() == name
    label = {"avx2": "AVX2", "avx512": "AVX-512"}[name]
    assert kernels.describe().startswith(f"morphserve {label} ")


def test_an_unknown_isa_setting_is_refused(fresh, monkeypatch) -> None:
    monkeypatch.setenv("MORPHSERVE_CPU_ISA", "sse2")
    with pytest.raises(ValueError, match="MORPHSERVE_CPU_ISA must be auto or one of avx2, avx512"):
        kernels.ops()


def test_a_variant_the_cpu_does_not_list_is_not_built(fresh, monkeypatch) -> None:
    """Listing is no proof of executing, but a missing flag is proof enough of not: no child, no build."""
    monkeypatch.setattr(isa, "cpu_flags", lambda: {"avx2", "fma"})

    def no_child(variant: isa.Variant) -> tuple[bool, str, bool]:
        raise AssertionError("a CPU without the flags must not build or probe the variant")

    monkeypatch.setattr(isa, "_run_child", no_child)
    usable, why = isa.probe(isa.AVX512, kernels.build_dir(isa.AVX512).name, kernels.cache_dir())
    assert not usable and why == "the CPU does not list avx512f, avx512bw, avx512vl, avx512_vnni"


def test_a_cpu_without_avx512_runs_the_baseline_after_one_warning(fresh, monkeypatch, caplog) -> None:
    """An AVX2-only CPU (its flags as /proc/cpuinfo would list them): auto serves on AVX2, says why once."""
    monkeypatch.setattr(isa, "cpu_flags", lambda: {"avx2", "fma", "f16c"})
    with caplog.at_level(logging.WARNING, logger=kernels.__name__):
        assert kernels.ops() is not None and kernels.isa_name() == "avx2"
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "avx512 variant is not usable here (the CPU does not list avx512f" in warnings[0]
    assert kernels.describe().startswith("morphserve AVX2 ")


def test_a_variant_that_does_not_build_falls_back_with_one_warning(fresh, monkeypatch, tmp_path, caplog) -> None:
    """A compiler without the variant's flags (here: a source that does not compile) is not the CPU's verdict: auto
    falls back with one warning and nothing is cached, so a fixed toolchain is tried again."""
    source = tmp_path / "isa_plant_broken.cpp"
    source.write_text('#error "this compiler cannot build the variant"\n')
    broken = isa.Variant(name="broken", module="morphserve_isa_plant_broken", sources=(str(source),), headers=(),
                         cflags=("-O1",), checksum=0, requires=())
    monkeypatch.setitem(isa.VARIANTS, broken.name, broken)
    monkeypatch.setattr(isa, "PREFERENCE", [broken.name, *isa.PREFERENCE])
    with caplog.at_level(logging.WARNING, logger=kernels.__name__):
        assert kernels.ops() is not None and kernels.isa_name() in USABLE
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "broken variant is not usable here (its build failed" in warnings[0], warnings
    assert "broken" not in fresh.read_text()
