"""broadcast_params_ sends the weights only where ranks disagree (digest check first)."""

import torch

from moebit.testing import run_on_ranks


def _body(rank: int, world: int, case: str):
    import torch.distributed as dist

    from moebit.comm.collectives import broadcast_params_, same_on_all

    sent = []
    real = dist.broadcast

    def counting(t, src, group=None, **kw):
        sent.append(t.numel())
        return real(t, src, group=group, **kw)

    dist.broadcast = counting
    torch.manual_seed(0 if case != "params" else rank)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.LayerNorm(8))
    model.register_buffer("step", torch.tensor([float(rank if case == "buffer" else 0)]))
    # "experts": rank r holds expert r % 2, the same as rank r + 2 (its expert-dp group)
    expert = torch.nn.Parameter(torch.full((4,), float(rank % 2 if case != "expert" else rank)))
    expert.moebit_expert = True
    model.expert = expert
    groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    mine = groups[rank % 2]
    agree_before = same_on_all([p.data for p in model.parameters()])
    broadcast_params_(model, expert_dp_group=mine, expert_src=rank % 2,
                      is_expert=lambda p: getattr(p, "moebit_expert", False))
    dist.broadcast = real
    dense = [p.detach().reshape(-1) for p in model.parameters() if p is not expert]
    flat = torch.cat(dense + [expert.detach(), model.step])
    return agree_before, sum(sent), flat


def _run(case: str):
    return run_on_ranks(_body, 4, args=(case,), timeout=120)


def test_equal_replicas_send_nothing():
    out = _run("same")
    assert all(sent == 0 for _, sent, _ in out)
    assert not out[0][0]  # the experts differ between ep ranks, so the whole model does
    assert torch.equal(out[0][2], out[2][2]) and torch.equal(out[1][2], out[3][2])


def test_different_dense_weights_are_broadcast():
    out = _run("params")
    assert all(sent > 0 for _, sent, _ in out)
    dense = [flat[:-5] for _, _, flat in out]  # the expert (4) and the buffer (1) last
    assert all(torch.equal(dense[0], d) for d in dense[1:])


def test_a_differing_buffer_or_expert_is_broadcast():
    out = _run("buffer")
    assert all(torch.equal(out[0][2], o[2]) for o in out[2:3])
    assert all(o[2][-1] == 0 for o in out)
    out = _run("expert")
    experts = [flat[-5:-1] for _, _, flat in out]
    assert torch.equal(experts[0], experts[2]) and torch.equal(experts[1], experts[3])
    assert experts[0][0] == 0 and experts[1][0] == 1  # from each group's source rank
