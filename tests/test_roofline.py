"""The roofline probe (``specstack.host.roofline``) and its line in ``specstack doctor``. No timing thresholds:
the machine these run on is shared, so only that the numbers exist, are positive and name their instruction."""

from __future__ import annotations

import json

import pytest

from specstack.cli import main
from specstack.host import doctor, roofline, sysinfo

INSTRUCTIONS = {"AVX-512 VNNI": "vpdpbusd", "AVX-VNNI": "vpdpbusd", "AVX2": "vpmaddubsw+vpmaddwd",
                "NEON dotprod": "sdot"}


def test_probe_measures_one_core_and_the_threads_asked_for():
    r = roofline.measure((1, 2), buffer_mib=64)
    assert [p.threads for p in r.points] == [1, 2]
    for p in r.points:
        assert p.read_gbps > 0
        assert p.int8_gmacs > 0 or r.isa == "none"
    if r.isa != "none":
        assert INSTRUCTIONS[r.isa] in r.instruction
    assert "GB/s streaming read" in r.describe() and r.instruction in r.describe()


def test_the_isa_is_the_best_this_cpu_has():
    isa = roofline.measure((1,), buffer_mib=64).isa
    flags = sysinfo.cpu_flags()
    if "avx512_vnni" in flags and "avx512f" in flags:
        assert isa == "AVX-512 VNNI"
    elif "avx_vnni" in flags:
        assert isa == "AVX-VNNI"
    elif "avx2" in flags:
        assert isa == "AVX2"


@pytest.mark.skipif("avx2" not in sysinfo.cpu_flags(), reason="the AVX2 pair needs AVX2")
def test_the_avx2_pair_can_be_timed_on_a_vnni_machine_too():
    r = roofline.measure((1,), isa="avx2", buffer_mib=64)
    assert r.isa == "AVX2" and r.instruction.startswith("vpmaddubsw+vpmaddwd")
    assert r.points[0].int8_gmacs > 0


def test_the_binary_is_compiled_once_and_cached():
    first = roofline.binary()
    assert first.exists() and first.name.startswith("roofline-")
    assert roofline.binary() == first


def test_without_a_compiler_doctor_says_why_in_one_line(monkeypatch):
    monkeypatch.setenv("CC", "no-such-cc-anywhere")
    probed = roofline.probe(2)
    assert probed == {"error": "no C compiler (no-such-cc-anywhere) on PATH to build the roofline probe "
                               "(install gcc, or set CC)"}
    check = {c.name: c for c in doctor.evaluate(_facts(probed))}["roofline"]
    assert check.status == "info" and check.message.startswith("not measured: no C compiler")
    assert "\n" not in check.message


def test_doctor_json_carries_the_probe(capsys):
    assert main(["doctor", "--json", "-t", "1"]) in (0, 1)
    d = json.loads(capsys.readouterr().out)
    probed = d["facts"]["roofline"]
    assert [p["threads"] for p in probed["points"]] == [1]
    assert probed["points"][0]["read_gbps"] > 0
    assert any(c["name"] == "roofline" for c in d["checks"])


def test_doctor_without_the_probe(capsys):
    assert main(["doctor", "--json", "--no-roofline"]) in (0, 1)
    d = json.loads(capsys.readouterr().out)
    assert "roofline" not in d["facts"] and not any(c["name"] == "roofline" for c in d["checks"])


def test_the_check_reads_the_numbers():
    probed = {"isa": "AVX2", "instruction": "vpmaddubsw+vpmaddwd ymm",
              "points": [{"threads": 1, "read_gbps": 21.2, "int8_gmacs": 73.0},
                         {"threads": 4, "read_gbps": 60.0, "int8_gmacs": 290.0}]}
    check = {c.name: c for c in doctor.evaluate(_facts(probed))}["roofline"]
    assert check.message == ("one core: 21.2 GB/s streaming read, 73 GMAC/s int8; 4 threads: 60.0 GB/s streaming "
                             "read, 290 GMAC/s int8 (vpmaddubsw+vpmaddwd ymm, AVX2)")


def _facts(probed):
    f = doctor.gather_facts()
    f["roofline"] = probed
    return f
