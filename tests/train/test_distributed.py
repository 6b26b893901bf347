"""Data-parallel drafter training: the gradient average over real processes (gloo on CPU), and
`torchrun ... flashtree train-drafter` end to end on the embedded default model (its steps lower
rank 0's held-out loss, and z-lab's reference package gives flashtree's logits for the drafter
it saved)."""

from __future__ import annotations

import os
import subprocess
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from flashtree.distributed.tp import free_port
from flashtree.train import distributed
from flashtree.train.drafter import load_examples
from tests.train.test_train_cli import _train
from tests.train.trained_drafter_checks import (
    assert_reference_gives_our_block_logits,
    held_out_losses,
)


def _rank_main(rank: int, world: int, port: int, results) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    try:
        params = [torch.nn.Parameter(torch.zeros(3, 2)), torch.nn.Parameter(torch.zeros(5)),
                  torch.nn.Parameter(torch.zeros(1))]
        params[0].data.fill_(rank)  # rank 0's weights must win the broadcast
        distributed.broadcast_parameters(params)
        for i, p in enumerate(params[:2]):  # the last one has no gradient on any rank
            p.grad = torch.arange(p.numel(), dtype=torch.float32).view_as(p) * (rank + 1) + i
        distributed.average_gradients(params)
        distributed.check_in_step(params)
        steps = distributed.agree_on_min(100 + rank, torch.device("cpu"))
        drifted = ""
        params[1].data[0] += rank  # now rank 1 holds other weights
        try:
            distributed.check_in_step(params)
        except RuntimeError as e:
            drifted = str(e)
        results[rank] = ([p.grad.clone() if p.grad is not None else None for p in params],
                         params[0].data.clone(), steps, drifted)
    finally:
        dist.destroy_process_group()


def test_ranks_average_gradients_and_agree():
    world = 2
    with mp.Manager() as manager:
        results = manager.dict()
        mp.spawn(_rank_main, args=(world, free_port(), results), nprocs=world)
        results = dict(results)
    mean_factor = sum(r + 1 for r in range(world)) / world  # grads scale with rank + 1
    for rank in range(world):
        grads, weights, steps, drifted = results[rank]
        for i, g in enumerate(grads[:2]):
            expect = torch.arange(g.numel(), dtype=torch.float32).view_as(g) * mean_factor + i
            torch.testing.assert_close(g, expect)
        assert grads[2] is None
        assert torch.equal(weights, torch.zeros(3, 2))
        assert steps == 100
        assert "ranks drifted apart" in drifted


def test_torchrun_trains_one_drafter_on_two_processes(tmp_path, hf_gguf_model):
    data = tmp_path / "data.npz"  # at least ten examples: one is held out for validation
    _train("--out", str(tmp_path / "unused"), "--num-prompts", "12", "--max-new-tokens", "12",
           "--data", str(data))
    run = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
         "--master_port", str(free_port()), "-m", "flashtree", "train-drafter",
         "--target", "default", "--layers", "1", "--batch-size", "2", "--anchors", "4",
         "--steps", "3", "--log-every", "1", "--device", "cpu", "--data", str(data),
         "--out", str(tmp_path / "drafter")],
        capture_output=True, text=True, timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert run.returncode == 0, run.stderr[-3000:]
    assert "2 processes, 2 sequences each per step" in run.stdout
    assert run.stdout.count("step 3/3") == 1  # rank 0 alone logs
    # Rank 0 validates before the first step and after each: the group's steps end below the
    # initial drafter's held-out loss.
    losses = held_out_losses(run.stdout)
    assert len(losses) == 4 and losses[-1] < losses[0], losses
    assert_reference_gives_our_block_logits(tmp_path / "drafter", hf_gguf_model,
                                            load_examples(data)[0].tokens[:24])


def test_several_processes_need_saved_data():
    run = subprocess.run([sys.executable, "-m", "flashtree", "train-drafter", "--out", "unused"],
                         capture_output=True, text=True, timeout=120,
                         env={**os.environ, "WORLD_SIZE": "2"})
    assert run.returncode != 0
    assert "needs --data naming an existing file" in run.stderr
