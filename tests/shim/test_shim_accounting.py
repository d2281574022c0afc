"""Property: whatever mix of allocation APIs, frees and refusals a process goes through, the shim's view of free
memory is exactly limit - (bytes still held), never above the total, never wrapped, and the region agrees."""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from shimkit import MiB

from alnair_agent.node.region import Region

LIMIT = 256 * MiB
KINDS = ["alloc", "managed", "async", "pool", "vmm"]

ops = st.lists(
    st.one_of(
        st.tuples(st.sampled_from(KINDS), st.integers(min_value=1, max_value=120 * MiB)),
        st.just(("free", 0)),
    ),
    min_size=1,
    max_size=25,
)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(script=ops)
def test_free_memory_is_always_limit_minus_what_is_held(runner, make_region, tmp_path, script):
    region = make_region(memory_limit=LIMIT, name=f"r{runner.n}")
    args = ["init"]
    for kind, size in script:
        args += ["free" if kind == "free" else f"{kind}:{size}", "info"]
    args.append("hold")
    p = runner.start(*args, region=region)
    from shimkit import release, wait_holding

    try:
        lines = wait_holding(p)
        held: list[int] = []
        infos = [ln for ln in lines if ln.startswith("info ")]
        results = [ln for ln in lines[1:] if not ln.startswith("info ") and ln != "holding"]
        assert len(infos) == len(script) == len(results)
        for (kind, size), res, info in zip(script, results, infos, strict=True):
            if kind == "free":
                if held:
                    held.pop()
                    assert res == "free rc=0"
            else:
                rc = int(res.split("rc=")[1].split()[0])
                fits = sum(held) + size <= LIMIT
                assert rc == (0 if fits else 2), (res, held, size)
                if rc == 0:
                    held.append(size)
            kv = dict(w.split("=") for w in info.split()[1:])
            assert int(kv["total"]) == LIMIT
            assert int(kv["free"]) == LIMIT - sum(held)
        [slot] = Region.open(region).slots()
        assert slot.memory_used == sum(held)
    finally:
        release(p)
