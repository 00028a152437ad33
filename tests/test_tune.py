"""The per-GPU tuner (gqla_triton.tune) under a tiny search: candidates checked against float64, the best kept,
a complete table written that dispatch accepts, and a resumed run measures nothing twice."""

import json
import os

import pytest

from gqla_triton import dispatch, tune

SPACE = {"combine": {"num_warps": (2, 8), "elems": (1024,)}, "gdn_decode": {"bv": (16, 32)}}


def test_tuner_writes_a_complete_valid_table_and_resumes(tmp_path, monkeypatch):
    out = tmp_path / "configs" / "tuned.json"
    res = tune.tune(["combine", "gdn_decode"], out=out, space=SPACE, progress=False)
    table = json.loads(out.read_text())
    parsed = dispatch.parse_table(table, where=str(out))  # dispatch accepts what the tuner writes
    assert set(parsed) >= {"combine", "gdn_decode", "gdn_chunk", "mla_decode", "gqa_decode"}  # complete
    assert {r["target"].split()[0] for r in res["report"]} == {"combine", "gdn_decode"}
    for r in res["report"]:
        assert "error" not in r and r["tuned_ms"] > 0
        op = r["target"].split()[0]
        assert parsed[op][-1][1].as_dict() == r["config"]  # the tuned entry is the catch-all it tuned
    state = json.loads(out.with_name(out.name + ".partial.json").read_text())
    assert len(state["measured"]) >= 1 + 2  # the current entry of each target plus candidates
    calls = []
    monkeypatch.setattr(tune, "_time_ms", lambda fn, graph: calls.append(1) or 1.0)
    monkeypatch.setattr(tune, "_retime", lambda t, cfg: calls.append(1) or 1.0)
    tune.tune(["combine", "gdn_decode"], out=out, space=SPACE, progress=False)
    assert not calls, "a resumed run timed candidates it had already measured"


def test_an_inaccurate_candidate_never_wins(tmp_path, monkeypatch):
    """A candidate whose check fails (here: NaN for num_warps 8) is dropped, however fast it runs."""
    target = tune.targets(["combine"])[0]
    honest = target.check

    def check():
        if dispatch.select_config("combine", {"D": 32}).num_warps == 8:
            return float("nan")
        return honest()

    target.check = check
    monkeypatch.setattr(tune, "_time_ms", lambda fn, graph: 1.0 if dispatch.select_config(
        "combine", {"D": 32}).num_warps == 8 else 2.0)
    res = tune.tune(["combine"], out=tmp_path / "t.json", space={"combine": {"num_warps": (8,)}}, progress=False,
                    target_list=[target])
    assert res["report"][0]["config"]["num_warps"] != 8


def test_a_candidate_whose_results_change_never_wins(tmp_path, monkeypatch):
    """The repeatability check: a candidate (num_warps 8) whose output differs between identical calls, as a
    miscompiled pipelined loop's does, is dropped, however fast and however accurate its first call."""
    import torch

    calls = []

    def run():
        calls.append(1)
        noisy = dispatch.select_config("combine", {"D": 32}).num_warps == 8
        return [torch.full((4,), 1.0 + (1e-7 * len(calls) if noisy else 0.0))]

    target = tune.targets(["combine"])[0]
    target.check = lambda: tune._rel(tune._repeatable(run)[0], torch.ones(4))
    monkeypatch.setattr(tune, "_time_ms", lambda fn, graph: 1.0 if dispatch.select_config(
        "combine", {"D": 32}).num_warps == 8 else 2.0)
    res = tune.tune(["combine"], out=tmp_path / "t.json", space={"combine": {"num_warps": (8,)}}, progress=False,
                    target_list=[target])
    assert res["report"][0]["config"]["num_warps"] != 8
    with pytest.raises(RuntimeError, match="differ between identical calls"):
        with dispatch.config_override({"combine": {"num_warps": 8}}):
            tune._repeatable(run)


def test_a_faster_accurate_candidate_wins(tmp_path, monkeypatch):
    target = tune.targets(["combine"])[0]
    monkeypatch.setattr(tune, "_time_ms", lambda fn, graph: 1.0 if dispatch.select_config(
        "combine", {"D": 32}).num_warps == 8 else 2.0)
    res = tune.tune(["combine"], out=tmp_path / "t.json", space={"combine": {"num_warps": (8,)}}, progress=False,
                    target_list=[target])
    r = res["report"][0]
    assert r["config"]["num_warps"] == 8 and r["tuned_ms"] == len(target.calls) * 1.0 < r["current_ms"]


def test_unknown_op_is_refused():
    with pytest.raises(ValueError, match="ops: unknown"):
        tune.targets(["gdn_chnuk"])


def test_user_table_takes_precedence(tmp_path, monkeypatch):
    """dispatch reads a tuned table from the user config directory before the shipped one (not under the
    interpreter, whose pinned table is fixed)."""
    monkeypatch.setenv("GQLA_TRITON_CONFIG_DIR", str(tmp_path))
    (tmp_path / "h200.json").write_text(json.dumps({"combine": [{"match": {}, "config": {"elems": 64}}]}))
    dispatch.reload_tables()
    try:
        assert dispatch.table_config("h200", "combine", {"D": 64}).elems == 64
        assert dispatch.table_config("interpreter", "combine", {"D": 64}).elems != 64
        # a partial table: the ops and shapes it leaves out keep the shipped rows, not default.json's
        (tmp_path / "h200.json").write_text(json.dumps({"combine": [{"match": {"D": 32}, "config": {"elems": 16}}]}))
        dispatch.reload_tables()
        shipped = dispatch._read_table(dispatch._CONFIG_DIR / "h200.json")
        assert dispatch.table_config("h200", "combine", {"D": 32}).elems == 16
        assert dispatch.table_config("h200", "combine", {"D": 64}) == dispatch._match(shipped, "combine", {"D": 64})
        assert dispatch._load_table("h200")["gdn_chunk"] == shipped["gdn_chunk"]
    finally:
        dispatch.reload_tables()


def test_search_from_the_default_table_reports_the_shipped_entry(tmp_path, monkeypatch):
    """``start="default"`` searches from configs/default.json and times this GPU's own entry beside the winner
    (shipped_ms); here the interpreter's pinned table plays the shipped one."""
    monkeypatch.setattr(tune, "_time_ms", lambda fn, graph: 2.0 if dispatch.select_config(
        "combine", {"D": 32}).num_warps == 8 else 1.0)
    monkeypatch.setattr(tune, "_retime", lambda t, cfg: 2.0 if cfg.num_warps == 8 else 1.0)
    default = dispatch._load_table("default")["combine"][-1][1]
    res = tune.tune(["combine"], out=tmp_path / "t.json", space={"combine": {"num_warps": (2, 8)}}, progress=False,
                    start="default")
    r = res["report"][0]
    assert "shipped_ms" in r and r["tuned_ms"] <= r["current_ms"]
    assert r["config"]["num_warps"] != 8
    assert r["config"]["elems"] == default.elems  # the fields not searched: the default table's


@pytest.mark.parametrize("kw, err, msg", [({"start": "shipped"}, ValueError, "start: expected"),
                                          ({"start": 3}, TypeError, "start: expected one of"),
                                          ({"jobs": -1}, ValueError, "jobs: expected"),
                                          ({"jobs": 1.5}, TypeError, "jobs: expected"),
                                          ({"budget_minutes": -1}, ValueError, "budget_minutes"),
                                          ({"budget_minutes": 0}, ValueError, "budget_minutes"),
                                          ({"budget_minutes": float("nan")}, ValueError, "budget_minutes"),
                                          ({"budget_minutes": float("inf")}, ValueError, "budget_minutes"),
                                          ({"budget_minutes": True}, TypeError, "budget_minutes"),
                                          ({"budget_minutes": "5"}, TypeError, "budget_minutes")])
def test_bad_options_are_refused(kw, err, msg, tmp_path):
    with pytest.raises(err, match=msg):
        tune.tune(["combine"], out=tmp_path / "t.json", progress=False, **kw)


def test_an_output_path_that_cannot_be_written_is_refused_before_the_search(tmp_path, monkeypatch):
    """``out`` is checked before any measurement: a folder, a non-path, a file in a read-only folder; an
    unreadable partial search beside it is named, not parsed into a traceback."""
    monkeypatch.setattr(tune, "_time_ms", lambda fn, graph: pytest.fail("measured before out was checked"))
    with pytest.raises(ValueError, match="is a directory"):
        tune.tune(["combine"], out=tmp_path, progress=False)
    with pytest.raises(TypeError, match="out: expected a path"):
        tune.tune(["combine"], out=3, progress=False)
    (tmp_path / "t.json.partial.json").write_text("{not json")
    with pytest.raises(ValueError, match="unreadable partial search"):
        tune.tune(["combine"], out=tmp_path / "t.json", progress=False)
    if os.geteuid() != 0:  # root writes anywhere
        ro = tmp_path / "ro"
        ro.mkdir(mode=0o500)
        with pytest.raises(ValueError, match="cannot be written"):
            tune.tune(["combine"], out=ro / "t.json", progress=False)


def test_worker_processes_compile_ahead_and_change_no_result(tmp_path, monkeypatch):
    """``jobs``: spawned workers run each step's candidates once before they are timed here; the search and the
    table it writes are those of a run without them."""
    monkeypatch.setattr(tune, "_time_ms", lambda fn, graph: 1.0 if dispatch.select_config(
        "combine", {"D": 32}).num_warps == 8 else 2.0)
    monkeypatch.setattr(tune, "_retime", lambda t, cfg: 1.0 if cfg.num_warps == 8 else 2.0)
    plain = tune.tune(["combine"], out=tmp_path / "a.json", space=SPACE, progress=False)
    pooled = tune.tune(["combine"], out=tmp_path / "b.json", space=SPACE, progress=False, jobs=1)
    assert [r["config"] for r in pooled["report"]] == [r["config"] for r in plain["report"]]
    assert pooled["report"][0]["config"]["num_warps"] == 8
    assert tune._warm_one(["combine"], "combine {}", "combine", {"num_warps": 2}) == ""
    assert "ValueError" in tune._warm_one(["combine"], "combine {}", "combine", {"num_warps": 3})


def test_joint_moves_and_repeated_passes_leave_a_local_minimum(tmp_path, monkeypatch):
    """A landscape where neither field alone helps (from elems 4096 / num_warps 4, elems 2048 or num_warps 8 alone
    are slower) but the pair is faster: the ``"elems+num_warps"`` entry moves both at
    once; a later pass then re-tries a single field that the joint move made worth changing."""
    key = dispatch.device_info().key
    raw = {op: [{"match": m, "config": c.as_dict()} for m, c in rows]
           for op, rows in dispatch._load_table(key).items()}
    raw["combine"] = [{"match": {}, "config": {"elems": 4096, "num_warps": 4}}]  # the start, whatever the GPU

    def cost(cfg):
        return {(4096, 4): 2.0, (2048, 4): 3.0, (4096, 8): 3.0, (2048, 8): 1.0, (2048, 2): 0.5}.get(
            (cfg.elems, cfg.num_warps), 9.0)

    def timed(fn, graph):
        return cost(dispatch.select_config("combine", {"D": 32}))

    monkeypatch.setattr(tune, "_time_ms", timed)
    monkeypatch.setattr(tune, "_retime", lambda t, cfg: cost(cfg))
    with dispatch.table_swap(key, raw):
        single = tune.tune(["combine"], out=tmp_path / "a.json", progress=False,
                           space={"combine": {"elems": (2048,), "num_warps": (8,)}})
        joint = tune.tune(["combine"], out=tmp_path / "b.json", progress=False,
                          space={"combine": {"num_warps": (2,), "elems+num_warps": ((2048, 8),)}})
    assert (single["report"][0]["config"]["elems"], single["report"][0]["config"]["num_warps"]) == (4096, 4)
    # pass 1: num_warps 2 alone (9.0) loses, the pair wins (1.0); pass 2: num_warps 2 from there wins (0.5)
    assert (joint["report"][0]["config"]["elems"], joint["report"][0]["config"]["num_warps"]) == (2048, 2)


def test_gluon_targets_start_from_their_own_impl_and_the_faster_kernel_is_auto():
    """A table without a Gluon entry (the default one) still starts the Gluon targets at ``impl="gluon"``; the
    written Gluon entries keep ``impl="gluon"`` only where the tuned Gluon kernel beat the tuned portable one."""
    default = dispatch._load_table("default")
    target = tune.Target("mla_decode", {"impl": "gluon"}, [], lambda: 0.0, {}, fixed={"block_n": 64, "num_stages": 2})
    start = tune._entry(default, target)
    assert (start.impl, start.block_n, start.num_stages) == ("gluon", 64, 2)
    with pytest.raises(ValueError, match="block_n"):  # the Gluon kernel has one key ring: a table cannot ask another
        tune._entry(default, tune.Target("mla_decode", {"impl": "gluon"}, [], lambda: 0.0, {}))
    assert tune._entry(default, tune.Target("mla_decode", {}, [], lambda: 0.0, {})).impl == "triton"
    raw = {"mla_decode": [{"match": {"impl": "gluon", "sparse": True}, "config": {"impl": "gluon"}},
                          {"match": {"impl": "gluon"}, "config": {"impl": "gluon"}}, {"match": {}, "config": {}}]}
    tune._pick_impl(raw, [{"target": "mla_decode gluon dense", "tuned_ms": 2.0},
                          {"target": "mla_decode triton dense", "tuned_ms": 1.0},
                          {"target": "mla_decode gluon sparse", "tuned_ms": 1.0},
                          {"target": "mla_decode triton sparse", "tuned_ms": 2.0}])
    assert [r["config"].get("impl") for r in raw["mla_decode"]] == ["gluon", "triton", None]


def test_table_swap_is_seen_by_select_config_and_undone():
    """The tuner measures the decode paths under the table it writes: ``table_swap`` replaces a GPU's table for
    the block (cached lookups included) and restores it after, also when the block raises."""
    key = dispatch.device_info().key
    before = dispatch.select_config("combine", {"D": 32})
    raw = {op: [{"match": m, "config": c.as_dict()} for m, c in rows]
           for op, rows in dispatch._load_table(key).items()}
    raw["combine"] = [{"match": {}, "config": {"elems": 1024, "num_warps": 2}}]
    with pytest.raises(RuntimeError), dispatch.table_swap(key, raw):
        assert (dispatch.select_config("combine", {"D": 32}).elems,
                dispatch.select_config("combine", {"D": 32}).num_warps) == (1024, 2)
        raise RuntimeError
    assert dispatch.select_config("combine", {"D": 32}) == before
    with pytest.raises(ValueError), dispatch.table_swap(key, {"combine": [{"match": {}, "config": {"elems": -1}}]}):
        pass
    assert dispatch.select_config("combine", {"D": 32}) == before


def test_stage_moves_are_judged_by_their_kernels(tmp_path, monkeypatch):
    """A many-kernel op (``Target.stages``): a move within one stage wins on that stage's kernel time although the
    whole time is within noise, and loses when the whole time gets worse by more than ``GAIN``; without stages the
    same move needs the whole time to improve."""
    base = tune.targets(["combine"])[0]

    def kernels(cfg):
        return {"combine_splits_kernel": 0.5 if cfg.num_warps == 8 else 1.0, "other_kernel": 5.0}

    def run(stages, total):
        t = tune.Target(base.op, base.key, base.calls, base.check, {"num_warps": (8,)}, stages=stages)
        monkeypatch.setattr(tune, "_time_ms", lambda fn, graph: total(dispatch.select_config("combine", {"D": 32})))
        monkeypatch.setattr(tune, "_kernel_ms", lambda calls: kernels(dispatch.select_config("combine", {"D": 32})))
        monkeypatch.setattr(tune, "_retime", lambda tt, cfg: total(cfg))
        out = tmp_path / f"{len(list(tmp_path.iterdir()))}.json"
        return tune.tune(["combine"], out=out, progress=False, target_list=[t])["report"][0]["config"]["num_warps"]

    flat = lambda cfg: 1.0  # noqa: E731 (the whole time does not move)
    worse = lambda cfg: 1.02 if cfg.num_warps == 8 else 1.0  # noqa: E731
    assert run({"num": ("combine_splits_kernel",)}, flat) == 8
    assert run({"num": ("combine_splits_kernel",)}, worse) != 8
    assert run({}, flat) != 8
    gdn = tune._gdn_chunk_target(True)
    assert gdn.stage_kernels("wy_bwd_bv+wy_bwd_num_warps") == ("gdn_wy_bwd_kernel",)
    assert gdn.stage_kernels("state_bv+state_num_warps") == ("gdn_state_fwd_kernel",)
    assert gdn.stage_kernels("state_bwd_num_stages") == ("gdn_state_bwd_kernel",)
    assert gdn.stage_kernels("seg_units") == ()


def _interrupted_at_gdn_decode(out, monkeypatch):
    """A run over combine and gdn_decode stopped (KeyboardInterrupt) as its search reaches gdn_decode; returns the
    real ``_search``, put back."""
    search = tune._search

    def stop_at_gdn(t, *a, **kw):
        if t.op == "gdn_decode":
            raise KeyboardInterrupt
        return search(t, *a, **kw)

    monkeypatch.setattr(tune, "_search", stop_at_gdn)
    with pytest.raises(KeyboardInterrupt):
        tune.tune(["combine", "gdn_decode"], out=out, space=SPACE, progress=False)
    monkeypatch.setattr(tune, "_search", search)
    return search


def test_an_interrupted_run_resumes_with_what_its_time_limit_has_left(tmp_path, monkeypatch):
    """A run stopped during its second target: the next run takes the first target's row as it was (nothing timed
    again), searches the second, counts both runs' search time against one time limit, and marks the file complete,
    so the run after that starts a new time limit."""
    out = tmp_path / "t.json"
    partial = out.with_name(out.name + ".partial.json")
    _interrupted_at_gdn_decode(out, monkeypatch)
    state = json.loads(partial.read_text())
    assert list(state["done"]) == ["combine {}"] and state["spent_s"] >= 0 and "complete" not in state
    assert not out.exists()
    timed = []
    monkeypatch.setattr(tune, "_measure", lambda t, cfg, **kw: timed.append(t.op) or tune._State.get(kw["state"], t,
                                                                                                     cfg) or
                        {"err": 0.0, "ms": 1.0, "parts": [1.0]})
    res = tune.tune(["combine", "gdn_decode"], out=out, space=SPACE, progress=False)
    assert "combine" not in timed and "gdn_decode" in timed
    assert [r["target"] for r in res["report"]] == ["combine {}", "gdn_decode {}"]
    assert res["runs"] == 2 and res["spent_s"] >= state["spent_s"]
    assert json.loads(partial.read_text())["complete"] is True
    again = tune.tune(["combine"], out=out, space=SPACE, progress=False)
    assert again["runs"] == 1


def test_a_hopeless_candidate_stops_being_timed(tmp_path, monkeypatch):
    """Workloads are timed one by one: a candidate far slower on the first one is not timed on the others (and
    never wins); one slightly slower there but faster in all is timed in full and wins."""
    base = tune.targets(["combine"])[0]
    calls = [base.calls[0]] * 3
    seen = []

    def run(first_ms, rest_ms):
        seen.clear()

        def timed(fn, graph):
            fast = dispatch.select_config("combine", {"D": 32}).num_warps == 8
            seen.append(fast)
            return (first_ms if len([s for s in seen if s == fast]) == 1 else rest_ms) if fast else 1.0

        t = tune.Target(base.op, base.key, calls, base.check, {"num_warps": (8,)})
        monkeypatch.setattr(tune, "_time_ms", timed)
        monkeypatch.setattr(tune, "_retime", lambda tt, cfg: (first_ms + 2 * rest_ms) if cfg.num_warps == 8 else 3.0)
        out = tmp_path / f"{len(list(tmp_path.iterdir()))}.json"
        return tune.tune(["combine"], out=out, progress=False, target_list=[t])["report"][0]

    row = run(10.0, 1.0)
    assert seen.count(True) == 1 and row["config"]["num_warps"] != 8 and row["slower"] == 1
    row = run(1.2, 0.5)
    assert seen.count(True) == 3 and row["config"]["num_warps"] == 8 and row["slower"] == 0
    assert not tune._hopeless([1.0], None) and not tune._hopeless([5.0, 1.0], {"parts": [1.0, 1.0]})
    assert tune._hopeless([5.0], {"parts": [1.0, 1.0]})


def test_a_wave_after_a_new_best_compiles_the_fields_still_ahead(monkeypatch, tmp_path):
    """With compile workers: after the first field's move wins, the wave holds the new best's moves along the
    fields after it in this pass; the next pass's wave holds those before."""
    waves = []

    class Pool:
        def warm(self, work, state, timeout=None):
            waves.append(sorted({(c.elems, c.num_warps) for _, cfgs in work for c in cfgs}))

    def cost(cfg):
        return 1.0 if cfg.elems == 2048 else 2.0

    monkeypatch.setattr(tune, "_time_ms", lambda fn, graph: cost(dispatch.select_config("combine", {"D": 32})))
    monkeypatch.setattr(tune, "_retime", lambda t, cfg: cost(cfg))
    key = dispatch.device_info().key
    raw = {op: [{"match": m, "config": c.as_dict()} for m, c in rows]
           for op, rows in dispatch._load_table(key).items()}
    raw["combine"] = [{"match": {}, "config": {"elems": 1024, "num_warps": 4}}]
    t = tune.targets(["combine"])[0]
    space = {"combine": {"elems": (2048,), "num_warps": (2, 8)}}
    state = tune._State(tmp_path / "s.json", key)
    with dispatch.table_swap(key, raw):
        row = tune._search(t, dispatch._load_table(key), None, space, state, Pool(), tune._NoBar(),
                           deadline=float("inf"))
    assert row["config"]["elems"] == 2048
    # one wave: the new best's num_warps moves (not its elems ones); the next pass's elems moves are measured
    assert waves == [[(2048, 2), (2048, 8)]] and row["waves"] == 1


def test_a_resumed_run_from_another_start_searches_again(tmp_path, monkeypatch):
    """The finished targets of an interrupted ``start="table"`` search are not taken by a ``start="default"`` one."""
    out = tmp_path / "t.json"
    search = _interrupted_at_gdn_decode(out, monkeypatch)
    searched = []
    monkeypatch.setattr(tune, "_search", lambda t, *a, **kw: searched.append(t.op) or search(t, *a, **kw))
    res = tune.tune(["combine", "gdn_decode"], out=out, space=SPACE, progress=False, start="default")
    assert searched == ["combine", "gdn_decode"] and res["runs"] == 1


def test_the_cli_names_a_bad_option_without_a_traceback(capsys):
    with pytest.raises(SystemExit) as e:
        tune.main(["--budget-minutes", "nan", "--ops", "combine"])
    assert e.value.code == 2 and "budget_minutes: expected a positive" in capsys.readouterr().err


def test_an_empty_op_list_is_refused_before_anything_is_written(tmp_path):
    """``ops=[]`` names no op to tune: a ValueError naming ``ops``, and no table is written (one would repeat the
    shipped rows ahead of them in the user config directory)."""
    out = tmp_path / "t.json"
    for ops in ([], ()):
        with pytest.raises(ValueError, match="^ops: expected None .* or a non-empty list"):
            tune.tune(ops, budget_minutes=0.1, out=out, progress=False)
    assert list(tmp_path.iterdir()) == []


def test_bad_options_and_partial_files_are_refused_before_any_search(tmp_path):
    out = tmp_path / "t.json"
    bad = [(dict(ops="combine"), TypeError, "ops: expected None or a list"),
           (dict(ops=5), TypeError, "ops: expected None or a list"),
           (dict(ops=["combine"], space=[1]), TypeError, "space: expected a mapping"),
           (dict(ops=["combine"], space={"combine": {"bogus": (1, 2)}}), ValueError, "space: 'combine' has no field"),
           (dict(ops=["combine"], space={"nope": {}}), ValueError, "space: unknown op 'nope'"),
           (dict(ops=["combine"], space={"combine": {"num_warps": ()}}), ValueError, "non-empty sequence"),
           (dict(ops=["combine"], space={"combine": {"elems+num_warps": (2048, 8)}}), ValueError,
            r"space: combine.elems\+num_warps .*a \(elems, num_warps\) tuple, got 2048"),
           (dict(ops=["combine"], space={"combine": {"elems+num_warps": ((2048,),)}}), ValueError,
            r"space: combine.elems\+num_warps .*got \(2048,\)"),
           (dict(ops=["combine"], budget_minutes=10**400), ValueError, "budget_minutes")]
    for kw, err, msg in bad:
        with pytest.raises(err, match=msg):
            tune.tune(**{"budget_minutes": 0.1, **kw}, out=out, progress=False)
    partial = tmp_path / "t.json.partial.json"
    # the file of this machine's search: its table key, its combine target's label
    gpu, label = dispatch.device_info().key, tune.targets(["combine"])[0].label()
    head = {"gpu": gpu, "start": "table", "measured": {}}
    texts = [{"gpu": gpu, "measured": []}, {"gpu": gpu, "spent_s": "abc"}, {"gpu": gpu, "done": []},
             {"gpu": gpu, "done": {"x": 1}}]
    texts += [{**head, "done": {label: row}} for row in (
        {"target": label, "config": 5}, {}, {"target": label, "config": {"bogus": 1}},
        {"target": label, "tuned_ms": "fast"})]
    for text in texts:
        partial.write_text(json.dumps(text))
        with pytest.raises(ValueError, match="an unreadable partial search"):
            tune.tune(["combine"], budget_minutes=0.1, out=out, progress=False)
    assert not out.exists()


def test_gqa_targets_tune_the_fill_entries_on_their_workloads(monkeypatch):
    """On a 132-SM GPU the dense grouped-decode workloads split between the catch-all entry (Q1) and the ``fill``
    entries that ``gqa.plan`` selects for them: one program per SM or less (B1, B8, B16) and two (Q3, B32)."""
    h200 = dispatch.DeviceInfo("NVIDIA H200", (9, 0), sm_count=132, smem_per_block=232448, l2_bytes=50 << 20)
    monkeypatch.setattr(dispatch, "device_info", lambda *a, **k: h200)
    got = {json.dumps(t.key, sort_keys=True): len(t.calls) for t in tune._gqa_targets(False) if not t.key.get("sparse")}
    assert got == {"{}": 1, '{"fill": 1, "rows": 16, "sparse": false}': 4,
                   '{"fill": 2, "rows": 16, "sparse": false}': 1, '{"d_r": 0, "rows": 4, "sparse": false}': 5}


def _on_gpu(monkeypatch, tmp_path, ms, name="NVIDIA H200"):
    """This process on a Hopper GPU of driver name ``name`` whose user config directory is ``tmp_path``; the
    targets are stand-ins (no kernel runs) whose time is ``ms(op, config)`` of the config in force."""
    info = dispatch.DeviceInfo(name, (9, 0), sm_count=132, smem_per_block=232448, l2_bytes=50 << 20)
    monkeypatch.setattr(dispatch, "device_info", lambda *a, **k: info)
    monkeypatch.setenv("GQLA_TRITON_CONFIG_DIR", str(tmp_path))
    monkeypatch.setattr(tune, "_time_ms", lambda fn, graph: fn())
    monkeypatch.setattr(tune, "_retime", lambda t, cfg: ms(t.op, cfg))
    dispatch.reload_tables()

    def target(op, space, key=None, fixed=None):
        key = key or {}
        return tune.Target(op, key, [lambda: lambda: ms(op, dispatch.select_config(op, key))],
                           lambda: 0.0, space, name=f"{op} {key}", fixed=fixed or {})
    return target


def test_a_second_run_tunes_over_the_table_the_first_one_wrote(tmp_path, monkeypatch):
    """A run on a GPU whose user config directory holds a tuned table (a first run's) searches from it and writes
    a valid table: the shipped rows the tuned ones hide are not written back, the first run's entries are kept."""
    fast = {"combine": ("num_warps", 8), "gdn_decode": ("bv", 32)}

    def ms(op, cfg):
        name, value = fast[op]
        return 1.0 if getattr(cfg, name) == value else 2.0

    target = _on_gpu(monkeypatch, tmp_path, ms)
    try:
        tune.tune(["combine"], progress=False, target_list=[target("combine", {"num_warps": (4, 8)})])
        assert dispatch.select_config("combine", {"D": 64}).num_warps == 8
        res = tune.tune(["gdn_decode"], progress=False, target_list=[target("gdn_decode", {"bv": (32, 64)})])
        written = dispatch._read_table(res["path"])
        assert dispatch.select_config("gdn_decode", {"K": 128, "V": 128}).bv == 32
        assert dispatch.select_config("combine", {"D": 64}).num_warps == 8  # the first run's entry
        shipped = dispatch._read_table(dispatch._CONFIG_DIR / "h200.json")
        for op, rows in shipped.items():  # every shape the shipped table names: as dispatch reads it
            for match, _ in rows:
                assert dispatch._match(written, op, match) == dispatch.table_config("h200", op, match)
    finally:
        dispatch.reload_tables()


def test_a_gpu_without_a_shipped_table_gets_a_tuned_table_of_its_own(tmp_path, monkeypatch):
    """Tuning on a GPU with no shipped table writes a table named for that GPU, not ``default.json`` (which every
    other such GPU reads): another unknown GPU keeps the shipped configs. A ``default.json`` written by hand into
    the user config directory serves every GPU that runs the shipped ``default.json``, beneath its own table (the
    tuned one is complete: it keeps its own rows)."""
    target = _on_gpu(monkeypatch, tmp_path, lambda op, cfg: 1.0 if cfg.num_warps == 8 else 2.0, "Acme X1 Accelerator")
    acme = dispatch.device_info()
    other = dispatch.DeviceInfo("Other GPU", (9, 0), sm_count=132, smem_per_block=232448, l2_bytes=50 << 20)
    shipped = dispatch._read_table(dispatch._CONFIG_DIR / "default.json")
    try:
        res = tune.tune(["combine"], progress=False, target_list=[target("combine", {"num_warps": (4, 8)})])
        assert res["path"] == tmp_path / "acme-x1-accelerator.json"
        assert not (tmp_path / "default.json").exists()
        assert dispatch.select_config("combine", {"D": 64}).num_warps == 8
        assert dispatch.select_config("combine", {"D": 64}, info=other) == shipped["combine"][-1][1]
        (tmp_path / "default.json").write_text(json.dumps({
            "combine": [{"match": {}, "config": {"num_warps": 2}}],
            "gdn_decode": [{"match": {}, "config": {"bv": 16}}]}))
        dispatch.reload_tables()
        assert dispatch.select_config("combine", {"D": 64}, info=other).num_warps == 2
        assert dispatch.select_config("combine", {"D": 64}, info=acme).num_warps == 8
        for info in (other, dispatch.DeviceInfo("NVIDIA H20", (9, 0), 78, 232448, 60 << 20)):
            assert dispatch.select_config("gdn_decode", {"K": 128, "V": 128}, info=info).bv == 16, info.name
    finally:
        dispatch.reload_tables()


class _Fault:
    """``io.open`` whose files, written a text that ``hit(text)`` picks, write its first half and fail (a full
    disk, a run killed mid-write); ``during(text)``, when given, runs inside such a write instead."""

    def __init__(self, monkeypatch, hit, during=None):
        import io

        real = io.open
        fault = self

        class File:
            def __init__(self, f):
                self.f = f

            def write(self, text):
                if not hit(text):
                    return self.f.write(text)
                if during is not None:
                    during(text)
                    return self.f.write(text)
                self.f.write(text[: len(text) // 2])
                self.f.flush()
                fault.hits += 1
                raise OSError(28, "No space left on device")

            def __getattr__(self, name):
                return getattr(self.f, name)

            def __enter__(self):
                return self

            def __exit__(self, *exc):
                return self.f.__exit__(*exc)

        self.hits = 0
        monkeypatch.setattr(io, "open", lambda *a, **k: File(real(*a, **k)))


def test_a_write_that_fails_midway_leaves_the_previous_table_whole(tmp_path, monkeypatch):
    """The table (and the partial search beside it) is written to a file of its own and renamed over the old one:
    a run that dies mid-write leaves the table a previous run wrote, which dispatch still reads, and no stray
    file."""
    out = tmp_path / "t.json"
    monkeypatch.setattr(tune, "_time_ms", lambda fn, graph: 1.0)
    tune.tune(["combine"], out=out, space={"combine": {"num_warps": (2,)}}, progress=False)
    before = out.read_text()
    files = sorted(tmp_path.iterdir())
    (out.with_name(out.name + ".partial.json")).unlink()  # the second run writes its search again
    fault = _Fault(monkeypatch, lambda text: '"gdn_chunk"' in text and '"measured"' not in text)
    with pytest.raises(OSError, match="No space left"):
        tune.tune(["combine"], out=out, space={"combine": {"num_warps": (8,)}}, progress=False)
    monkeypatch.undo()
    assert fault.hits == 1 and out.read_text() == before
    dispatch._read_table(out)
    assert sorted(tmp_path.iterdir()) == files


def test_two_runs_writing_one_partial_search_each_leave_a_whole_file(tmp_path, monkeypatch):
    """Two tuners saving the same partial search at once (here: one saves while the other's write is under way)
    each finish, and the file holds one whole search."""
    path = tmp_path / "t.json.partial.json"
    a, b = tune._State(path, "h200"), tune._State(path, "h200")
    a.data["measured"]["x"], b.data["measured"]["y"] = {"ms": 1.0}, {"ms": 2.0}
    _Fault(monkeypatch, lambda text: '"x"' in text, during=lambda text: b.save())
    a.save()
    monkeypatch.undo()
    assert json.loads(path.read_text())["measured"] == {"x": {"ms": 1.0}}
    assert sorted(p.name for p in tmp_path.iterdir()) == [path.name]


def test_new_entries_go_before_the_rows_that_would_hide_them(tmp_path, monkeypatch):
    """On a Hopper GPU without a table of its own (H20: ``default.json``) the MLA targets add entries the start
    table lacks ({"sparse"}, {"impl": "gluon"}, {"impl": "gluon", "sparse"}): each goes before the rows that would
    take its keys, the table is written, and each shape's lookup gets its own tuned entry."""
    target = _on_gpu(monkeypatch, tmp_path, lambda op, cfg: 1.0 if cfg.split_cost == 0.5 else 2.0, "NVIDIA H20")
    ring = {"block_n": 64, "num_stages": 2}
    keys = [({}, None), ({"sparse": True}, None), ({"impl": "gluon"}, ring), ({"impl": "gluon", "sparse": True}, ring)]
    try:
        res = tune.tune(["mla_decode"], progress=False, budget_minutes=1,
                        target_list=[target("mla_decode", {"split_cost": (0.05, 0.5)}, k, f) for k, f in keys])
        assert res["path"] == tmp_path / "h20.json"
        for (key, _), row in zip(keys, res["report"], strict=True):
            lookup = {"D": 576, "DV": 512, "s_q": 1, "fp32": False, "sparse": False, "impl": "triton", **key}
            cfg = dispatch.select_config("mla_decode", lookup)
            assert cfg.as_dict() == row["config"] and cfg.split_cost == 0.5, key
    finally:
        dispatch.reload_tables()


def test_a_table_that_is_a_link_is_written_through_it(tmp_path, monkeypatch):
    """An output table that is a symbolic link (a user table kept in a shared folder) stays a link: the file it
    names takes the new table."""
    shared = tmp_path / "shared" / "t.json"
    shared.parent.mkdir()
    shared.write_text("{}")
    out = tmp_path / "t.json"
    out.symlink_to(shared)
    monkeypatch.setattr(tune, "_time_ms", lambda fn, graph: 1.0)
    tune.tune(["combine"], out=out, space={"combine": {"num_warps": (2,)}}, progress=False)
    assert out.is_symlink() and "combine" in dispatch._read_table(shared)
