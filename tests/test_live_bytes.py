"""The step-peak meter (distlib/app/observe/live_bytes.py): every tensor alive counted once, by its
storage, until it is freed. What it measures in a run is set against the planner's dry step on
every layout of tests/test_plan_states.py (to the byte); here, what it counts."""

from __future__ import annotations

import torch

from distlib.app.observe.live_bytes import LiveBytes, StepMeter


def test_a_storage_counts_once_while_any_view_of_it_lives():
    meter = LiveBytes("cpu")
    with meter:
        a = torch.ones(100)  # 400 bytes
        b = a.view(10, 10)[2:]  # a view: nothing more
        c = a * 2  # 400 more
        assert (meter.now, meter.peak) == (800, 800)
        del a
        assert meter.now == 800  # b still holds the storage
        del b
        assert meter.now == 400
        d = torch.zeros(0)
        assert meter.now == 400  # an empty storage is 0 bytes
    del c, d
    assert (meter.now, meter.peak) == (0, 800)  # freed outside the mode still counts


def test_the_peak_is_the_most_alive_at_once_not_the_sum_allocated():
    meter = LiveBytes("cpu")
    with meter:
        for _ in range(5):
            t = torch.ones(50)  # 200 bytes each; each frees the one before once assigned
            del t
        assert meter.peak == 200
        kept = [torch.ones(50) for _ in range(3)]
        assert meter.peak == 600 and meter.now == 600
    meter.restart()
    assert meter.peak == 600
    kept.pop()
    meter.restart()
    assert meter.peak == meter.now == 400


def test_held_tensors_and_a_storage_resized_outside_the_dispatcher():
    buffer = torch.zeros(64)  # made before the meter: what ZeRO-3 holds between steps
    meter = LiveBytes("cpu")
    meter.hold([buffer, buffer[:8]])
    assert meter.now == 256
    with meter:
        buffer.untyped_storage().resize_(0)  # ZeRO-3 frees a unit so: no operator runs
        one = torch.ones(1)
        assert meter.now == 256 + 4  # a storage seen at one size only is not re-read
        view = torch.empty(0).set_(buffer.untyped_storage())  # an operator returns it: 0 bytes now
        assert meter.now == 4
        buffer.untyped_storage().resize_(128)  # refilled (a unit gathered): known to resize, so
        two = torch.ones(1)  # the next operator re-reads it
        assert meter.now == 128 + 4 + 4
    del view, one, two


def test_a_storage_emptied_in_the_build_counts_empty_from_the_restart_and_is_re_read_after():
    meter = LiveBytes("cpu")
    with meter:
        unit = torch.zeros(64)  # made whole in the build, as ZeRO-3's unit buffers are
        unit.untyped_storage().resize_(0)  # and emptied: no operator runs
    assert meter.now == 256  # (not re-read yet)
    meter.restart()  # the build's end (StepMeter.build)
    assert meter.now == meter.peak == 0  # before: every unit counted gathered through every step
    with meter:
        unit.untyped_storage().resize_(256)  # gathered in the step
        one = torch.ones(1)
        assert meter.now == 256 + 4
    del one


def test_memory_the_rank_did_not_allocate_and_other_devices_are_not_counted():
    meter = LiveBytes("cpu")
    board = bytearray(4096)  # shared memory, a NumPy array: not torch's allocation
    with meter:
        over = torch.frombuffer(board, dtype=torch.float32)
        part = over[:16].view(4, 4)
        assert meter.now == 0
        ignored = torch.ones(8)
    meta = LiveBytes("meta")
    with meta:
        torch.ones(8)  # on the CPU
        on_meta = torch.ones(8, device="meta")
        assert meta.now == 32
        meta.ignore([on_meta])
        on_meta.view(2, 4)
        assert meta.now == 32  # already counted; ignoring stops counting it anew
        fresh = torch.ones(4, device="meta")
        meta.ignore([fresh])
    del part, ignored, fresh
    windows = torch.zeros(8, device="meta")  # made unseen, as the dry step's batches
    dry = LiveBytes("meta")
    dry.ignore([windows])
    with dry:
        windows.view(2, 4)
        assert dry.now == 0
        del windows  # its key is free again: a storage made next may take it, and counts
        for _ in range(20):
            kept = torch.ones(8, device="meta")
            assert dry.now == 32
            del kept


def test_a_device_named_without_its_index_is_every_one_of_its_kind():
    meter = LiveBytes("cpu")
    assert meter._on_device(torch.device("cpu")) and not meter._on_device(torch.device("meta"))
    gpu, first = LiveBytes("cuda"), LiveBytes("cuda:0")
    assert gpu._on_device(torch.device("cuda", 0)) and gpu._on_device(torch.device("cuda", 1))
    assert first._on_device(torch.device("cuda", 0)) and not first._on_device(torch.device("cuda", 1))
    assert not gpu._on_device(torch.device("cpu"))


def test_the_step_meter_watches_the_build_and_the_first_two_steps_after_a_resume():
    off = StepMeter("cpu", False)
    with off.watch(1):
        torch.ones(10)
    assert off.fields() == {}
    on = StepMeter("cpu", True)
    on.begin(5)  # resumed after step 5
    watched = []
    for step in (0, 6, 7, 8):
        with on.watch(step):
            before = on.live.now
            kept = torch.ones(100)
            watched.append(on.live.now > before)
            del kept
    assert watched == [True, True, True, False]
    assert on.fields() == {"step_peak": 400}
