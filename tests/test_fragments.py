"""ZeRO's checkpoint pieces as DCP chunks (toolkit/checkpoint/fragments.py): a run of consecutive elements of a
flattened tensor is cut into boxes that cover exactly that run, and pieces written that way load back, through
DCP's own resharding, as the full tensor they came from."""

import math

import pytest
import torch
import torch.distributed.checkpoint as dcp
from hypothesis import given, settings
from hypothesis import strategies as st

from toolkit.checkpoint.fragments import Fragments, Piece, PiecesSavePlanner, boxes


@st.composite
def runs(draw):
    shape = tuple(draw(st.lists(st.integers(1, 6), min_size=0, max_size=4)))
    numel = math.prod(shape)
    start = draw(st.integers(0, numel - 1))
    return shape, start, draw(st.integers(1, numel - start))


@settings(max_examples=300, deadline=None)
@given(runs())
def test_the_boxes_of_a_run_are_exactly_its_elements_in_order(run):
    shape, start, numel = run
    full = torch.arange(math.prod(shape)).reshape(shape)
    seen = torch.zeros(shape, dtype=torch.long)
    got = []
    for offsets, sizes, begin in boxes(shape, start, numel):
        region = tuple(slice(o, o + s) for o, s in zip(offsets, sizes))
        seen[region] += 1
        assert begin == len(got)  # where the box begins within the run
        got += full[region].reshape(-1).tolist()
    # the reference: the run read off the flattened tensor by plain indexing
    assert got == full.reshape(-1)[start:start + numel].tolist()
    assert int(seen.sum()) == numel and int(seen.max()) == 1  # no element twice


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # one process, no group: DCP says so
def test_pieces_saved_as_chunks_load_back_as_the_full_tensors(tmp_path):
    torch.manual_seed(0)
    weight, moment = torch.randn(5, 3, 4), torch.randn(7)
    flat_w, flat_m = weight.reshape(-1), moment.reshape(-1)
    # three pieces of the weight, cut where a flat partition would cut it (mid-row, mid-plane), one of the moment
    cuts = [0, 7, 29, 60]
    pieces = [Piece("model.w", a, flat_w[a:b].clone()) for a, b in zip(cuts, cuts[1:])]
    pieces.append(Piece("optim.state.w.exp_avg", 0, flat_m.clone()))
    fragments = Fragments(pieces=pieces, shapes={"model.w": (5, 3, 4), "optim.state.w.exp_avg": (7,)},
                          whole={"optim.state.w.step": torch.tensor(3.0)})
    copy = fragments.flatten()  # what an async save writes (a sync one writes the views themselves)
    dcp.save(copy.state(), checkpoint_id=str(tmp_path), planner=PiecesSavePlanner(copy))
    loaded = {"model": {"w": torch.zeros(5, 3, 4)},
              "optim": {"state.w.exp_avg": torch.zeros(7), "state.w.step": torch.tensor(0.0)}}
    dcp.load(loaded, checkpoint_id=str(tmp_path))
    assert torch.equal(loaded["model"]["w"], weight)
    assert torch.equal(loaded["optim"]["state.w.exp_avg"], moment)
    assert float(loaded["optim"]["state.w.step"]) == 3.0


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_pieces_read_their_elements_from_a_checkpoint_of_full_tensors(tmp_path):
    """The resume side: a rank's pieces (views into its flat partition) filled in place from whatever chunks a
    checkpoint holds, here one written by a strategy that saves full tensors."""
    from toolkit.checkpoint.fragments import PiecesLoadPlanner

    torch.manual_seed(0)
    weight = torch.randn(6, 5)
    dcp.save({"model": {"w": weight}}, checkpoint_id=str(tmp_path))
    partition = torch.zeros(12)  # this rank's flat partition: elements 9-20 of the flattened weight
    pieces = Fragments(pieces=[Piece("model.w", 9, partition)], shapes={"model.w": (6, 5)}, whole={})
    dcp.load({}, checkpoint_id=str(tmp_path), planner=PiecesLoadPlanner(pieces))
    assert torch.equal(partition, weight.reshape(-1)[9:21])
