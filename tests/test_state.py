"""The pure parts of resilient mode's worker side, in one process: the loop API's
commits (steps/epochs/batches, break, on_commit), the restore point after an abandoned
iteration (tp_launch.resilient.rollback), the random generators' record
(tp_launch.resilient.rng, per_rank) and the DDP layout bookkeeping. Fast: no process
group, no spawn (the real-process suites cover those)."""

from __future__ import annotations

import random

import pytest
import torch

from tp_launch.resilient import per_rank, rng
from tp_launch.resilient.ddp import Layout, Layouts
from tp_launch.resilient.rollback import Rollback
from tp_launch.resilient.state import Cursor, Hooks, ResilientUsageError, State

pytestmark = pytest.mark.unit


class Recorder(Hooks):
    def __init__(self) -> None:
        self.events: list[tuple[str, int]] = []

    def entered(self, state: State) -> None:
        self.events.append(("entered", state.step))

    def committed(self, state: State) -> None:
        self.events.append(("committed", state.step))


def test_steps_commit_each_finished_iteration_and_run_callbacks_once():
    state = State()
    state.hooks = rec = Recorder()
    log = []
    for step in state.steps(3):
        state.on_commit(lambda step=step: log.append(step))
        assert log == list(range(step))  # the iteration's own callback has not run yet
    assert state.step == 3 and log == [0, 1, 2]
    assert rec.events == [("entered", 0), ("committed", 1), ("committed", 2), ("committed", 3)]
    assert list(state.steps(3)) == []  # nothing left


def test_an_exception_abandons_the_iteration():
    state = State()
    log = []
    with pytest.raises(ValueError):
        for step in state.steps(5):
            state.on_commit(lambda step=step: log.append(step))
            if step == 2:
                raise ValueError("a failed collective")
    state.abandon()  # what the runtime does: the iteration in flight is dropped
    assert state.step == 2 and log == [0, 1]
    assert list(state.steps(4)) == [2, 3]  # resumed at the committed step
    assert log == [0, 1]  # the dropped callback never runs


def test_break_settles_at_the_next_boundary():
    state = State()
    log = []
    for step in state.steps(10):
        state.on_commit(lambda step=step: log.append(step))
        if step == 4:
            break
    assert log == [0, 1, 2, 3] and state.step == 4  # not yet: a failure could follow
    state.end()  # train() returned: the broken iteration counts, training is over
    assert log == [0, 1, 2, 3, 4] and state.cursor.ended
    assert list(state.steps(10)) == []


def test_digest_is_the_training_state_not_whether_train_returned():
    """Two ranks at the last step, one told of a failure at its last commit (train() did
    not return), one already past state.end(): the same state, the same digest (the
    replicas' check after the recovery must not call them diverged)."""
    model = torch.nn.Linear(2, 2)
    late, done = State(model=model), State(model=model)
    for _ in late.steps(3):
        pass
    for _ in done.steps(3):
        pass
    done.end()
    assert done.cursor.ended and not late.cursor.ended
    assert late.digest(buffers=False) == done.digest(buffers=False)
    before = late.digest()
    with torch.no_grad():
        model.weight[0, 0] += 1.0
    assert late.digest() != before
    done.cursor.step += 1
    assert late.digest() != done.digest()


def test_epochs_and_batches_resume_mid_epoch_with_the_same_data():
    data = [f"b{i}" for i in range(5)]

    def run(state: State, stop_after: int | None = None) -> list[tuple[int, str]]:
        seen = []
        for epoch in state.epochs(2):
            for batch in state.batches(data):
                seen.append((epoch, batch))
                if stop_after is not None and len(seen) == stop_after:
                    raise RuntimeError("failure")
        return seen

    full = run(State())
    state = State()
    with pytest.raises(RuntimeError):
        run(state, stop_after=7)
    state.abandon()
    assert (state.epoch, state.batch, state.step) == (1, 1, 6)
    assert full[:6] + run(state) == full


def test_break_out_of_batches_ends_the_epoch_only():
    state = State()
    seen = []
    for epoch in state.epochs(3):
        for batch in state.batches(range(10)):
            if batch >= 2:
                break
            seen.append((epoch, batch))
    assert seen == [(e, b) for e in range(3) for b in range(2)]
    assert (state.epoch, state.step) == (3, 6)


def test_epoch_rng_is_replayed_when_resuming_mid_epoch():
    def epoch_draws(state: State, fail_at: int | None = None) -> list[float]:
        out = []
        for _ in state.epochs(1):
            loader = torch.utils.data.DataLoader(list(range(6)), shuffle=True)  # iter() draws
            for i, _batch in enumerate(state.batches(loader)):
                out.append(torch.rand(()).item())  # dropout-like draws
                if i == fail_at:
                    raise RuntimeError("failure")
        return out

    torch.manual_seed(3)
    full = epoch_draws(State())
    torch.manual_seed(3)
    state = State()
    rb = Rollback(state)
    state.hooks = _RollbackHooks(rb)
    with pytest.raises(RuntimeError):
        epoch_draws(state, fail_at=3)
    state.abandon()
    assert rb.restore()
    assert full[:3] + epoch_draws(state) == full


class _RollbackHooks(Hooks):
    def __init__(self, rb: Rollback) -> None:
        self.rb = rb

    def entered(self, state: State) -> None:
        self.rb.refresh_layout()
        self.rb.capture()

    def committed(self, state: State) -> None:
        self.rb.capture()


def _model_state(snapshot: str = "auto") -> tuple[torch.nn.Module, torch.optim.Optimizer,
                                                    State, Rollback]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4),
                                torch.nn.Dropout(0.5))
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5)
    state = State(model=model, optimizer=opt, scheduler=sched, snapshot=snapshot)
    rb = Rollback(state)
    state.hooks = _RollbackHooks(rb)
    return model, opt, state, rb


def _iteration(model, opt, state, stop: str = "") -> None:  # type: ignore[no-untyped-def]
    opt.zero_grad()
    loss = model(torch.randn(8, 4)).square().mean()
    loss.backward()
    if stop == "backward":
        raise RuntimeError(stop)
    opt.step()
    if stop == "step":
        raise RuntimeError(stop)
    state.scheduler.step()
    random.random()


def test_rollback_before_the_optimizer_step_is_exact():
    model, opt, state, rb = _model_state()
    for step in state.steps(3):
        _iteration(model, opt, state)
    before = state.digest()
    generators = rng.digests(rng.capture())
    with pytest.raises(RuntimeError):
        for step in state.steps(10):
            _iteration(model, opt, state, stop="backward")
    state.abandon()
    assert state.digest() != before  # BatchNorm statistics moved
    assert rb.restorable() and rb.restore()
    assert state.digest() == before and rng.digests(rng.capture()) == generators
    assert all(p.grad is None or not p.grad.any() for p in model.parameters())


def test_after_the_optimizer_step_only_a_snapshot_restores():
    model, opt, state, rb = _model_state(snapshot="never")
    for step in state.steps(2):
        _iteration(model, opt, state)
    with pytest.raises(RuntimeError):
        for step in state.steps(10):
            _iteration(model, opt, state, stop="step")
    state.abandon()
    assert not rb.restorable() and not rb.restore()

    model, opt, state, rb = _model_state(snapshot="always")
    for step in state.steps(2):
        _iteration(model, opt, state)
    before = state.digest()
    with pytest.raises(RuntimeError):
        for step in state.steps(10):
            _iteration(model, opt, state, stop="step")
    state.abandon()
    assert rb.restore() and state.digest() == before


def test_an_optimizer_step_outside_the_loop_is_a_usage_error():
    model, opt, state, rb = _model_state()
    model(torch.randn(8, 4)).sum().backward()
    with pytest.raises(ResilientUsageError, match="state.steps"):
        opt.step()
    rb.close()
    opt.step()  # without resilient mode's hook: allowed


def test_generator_record_round_trip_and_torn_write(tmp_path):
    random.seed(5)
    torch.manual_seed(5)
    state = rng.capture()
    assert rng.from_bytes(rng.to_bytes(state)).keys() == state.keys()
    assert rng.digests(rng.from_bytes(rng.to_bytes(state))) == rng.digests(state)
    path = str(tmp_path / "rec")
    writer = per_rank.Record(path, create=True)
    writer.write(3, False, per_rank.encode(state, [b"\x01\x02"]))
    writer.write(4, True, per_rank.encode(state, None))
    reader = per_rank.Record(path, create=False)
    assert reader.at(3).buffers == [b"\x01\x02"] and not reader.at(3).provisional
    assert reader.at(4).provisional and reader.at(4).buffers is None
    assert reader.at(5) is None
    # A process killed while writing: the half-written region does not read as an entry,
    # and the previous commit (never overwritten by the next write) is still there.
    writer.write(5, False, per_rank.encode(state, [b"\x03"]))
    writer._mm[writer._region(writer._committed_region) + 60] ^= 0xFF  # corrupt its data
    assert per_rank.Record(path, create=False).at(5) is None
    assert per_rank.Record(path, create=False).at(3).buffers == [b"\x01\x02"]


def test_cursor_and_layout_wire_forms_validate():
    assert Cursor.from_tree(Cursor(3, 1, 2).to_tree()) == Cursor(3, 1, 2)
    with pytest.raises(ValueError):
        Cursor.from_tree({"step": -1, "epoch": 0, "batch": 0})
    layouts = Layouts(lambda: 0)
    layouts.adopt({"fp": Layout([[1, 0]], [100], 1).to_tree()})
    assert layouts.known["fp"].buckets == [[1, 0]]
    with pytest.raises(ValueError):
        layouts.adopt({"fp2": {"buckets": [["x"]], "limits": [], "from_step": 0}})


def test_module_state_is_its_own_tensors_never_through_state_dict():
    """What the runtime moves and compares of a module: its parameters (a tied weight
    once) and persistent buffers, the tensors themselves; no state-dict hook runs (a
    framework's may run a collective: TorchTitan's fused QKV redistributes on save)."""
    from tp_launch.resilient import sharding

    class Tied(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = torch.nn.Embedding(5, 3)
            self.head = torch.nn.Linear(3, 5, bias=False)
            self.head.weight = self.embed.weight
            self.norm = torch.nn.BatchNorm1d(3)
            self.register_buffer("scratch", torch.zeros(2), persistent=False)

    m = Tied()

    def hook(*_):
        raise AssertionError("a state-dict hook ran")

    m.register_state_dict_pre_hook(hook)
    m.head.register_state_dict_post_hook(hook)
    got = sharding.module_tensors(m)
    assert list(got) == ["embed.weight", "norm.weight", "norm.bias", "norm.running_mean",
                         "norm.running_var", "norm.num_batches_tracked"]
    assert got["embed.weight"] is m.embed.weight and got["norm.running_mean"] is m.norm.running_mean
    assert [n for n, _ in sharding.persistent_buffers(m)] == [
        "norm.running_mean", "norm.running_var", "norm.num_batches_tracked"]
    assert sharding.object_state(m) == got
    sgd = torch.optim.SGD(m.parameters(), lr=0.1)
    assert sharding.object_state(sgd) == sgd.state_dict()
    # Loaded in place into the module's own tensors.
    new = {k: torch.full_like(v, 7) for k, v in got.items()}
    sharding.load_module_pieces(m, new)
    assert bool((m.head.weight == 7).all()) and int(m.norm.num_batches_tracked) == 7
    with pytest.raises(ValueError, match="keys differ"):
        sharding.load_module_pieces(m, {"embed.weight": new["embed.weight"]})


def test_per_rank_names_are_a_collection_of_names():
    data = torch.optim.lr_scheduler.LambdaLR(
        torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1), lambda s: 1.0)
    assert State(per_rank={"data"}, data=data).per_rank == {"data"}
    with pytest.raises(TypeError, match="per_rank"):
        State(per_rank="data", data=data)


def test_modules_keeping_extra_state_are_named():
    from tp_launch.resilient import sharding

    class Scaled(torch.nn.Linear):
        def get_extra_state(self) -> dict:
            return {"calls": 0}

        def set_extra_state(self, state: dict) -> None:
            pass

    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Sequential(Scaled(2, 2)))
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    assert sharding.extra_state_holders({"model": model, "optimizer": sgd}) == ["model.1.0"]
    assert sharding.extra_state_holders({"head": Scaled(2, 2)}) == ["head"]
    assert sharding.extra_state_holders({"model": torch.nn.Linear(2, 2)}) == []
