"""k2lab.distributed on CPU ranks (gloo), launched by torchrun from the test: 2 ranks on an explicit uneven split
(the embedding and block 0 on rank 0, the rest on rank 1) and 3 ranks on the plan (0: embedding, blocks 0-1;
1: block 2; 2: block 3, norm, head). Each launch computes everything once (pipeline_worker.py); the tests compare
every rank's results with the same checkpoint loaded whole in this process, in float32."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from pipeline_worker import ABLATED, CONFIG, NEW_TOKENS, left_padding, token_ids, write_mini_checkpoint

import k2lab
from k2lab.analysis.interventions import ablate_experts
from k2lab.distributed import PipelinedK2, stage_map
from k2lab.weights.placement import unit_of
from k2lab.weights.reader import read_weight_map

WORKER = Path(__file__).with_name("pipeline_worker.py")
TWO_RANKS = {"": 1, "embed_tokens": 0, "layers.0": 0}  # uneven: the embedding and one block, then the rest
THREE_CAPACITIES = [2**40] * 3  # equal devices: the plan puts blocks 0-1 on rank 0, 2 on rank 1, 3 on rank 2
MISSING_SHARD = "model-4-of-6.safetensors"  # block 2's shard: rank 1's in the two-rank split


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    return write_mini_checkpoint(tmp_path_factory.mktemp("mini"))


@pytest.fixture(scope="module")
def reference(checkpoint) -> dict[str, object]:
    """What one process computes from the same checkpoint: the oracle every rank must match."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    model = k2lab.load(checkpoint, dtype=torch.float32)
    ids = token_ids()
    _, cache = model.run_with_cache(ids)
    ref = {"logits": model(ids), "cache": dict(cache), "logit_lens": cache.logit_lens(pos=-1),
           "attribution": cache.logit_attribution(int(ids[0, -1]), pos=-1).total(),
           "trace": k2lab.routing.trace(model, ids).indices,
           "greedy": k2lab.generate(model, ids, NEW_TOKENS),
           "masked_logits": model(ids, attention_mask=left_padding()),
           "masked_greedy": k2lab.generate(model, ids, NEW_TOKENS, attention_mask=left_padding()),
           "sampled": k2lab.generate(model, ids, NEW_TOKENS, temperature=1.0, top_k=50, seed=1)}
    with ablate_experts(model, ABLATED, mode="reroute"):
        ref["ablated"] = model(ids)
    torch.set_num_threads(threads)
    return ref


def launch(nproc: int, out: Path, *args: str) -> list[dict[str, object]]:
    """torchrun the worker on ``nproc`` CPU ranks (a free port on this host); every rank's saved results."""
    root = str(Path(k2lab.__file__).parents[1])
    path = os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": path}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", str(WORKER),
           "--out", str(out), *args]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)  # a hang fails, not blocks
    assert done.returncode == 0, f"torchrun failed:\n{done.stdout[-4000:]}\n{done.stderr[-4000:]}"
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(nproc)]


@pytest.fixture(scope="module")
def two_ranks(checkpoint, tmp_path_factory) -> list[dict[str, object]]:
    broken = Path(shutil.copytree(checkpoint, tmp_path_factory.mktemp("broken") / "ckpt"))
    (broken / MISSING_SHARD).unlink()
    return launch(2, tmp_path_factory.mktemp("two"), "--model", str(checkpoint), "--stages", json.dumps(TWO_RANKS),
                  "--broken", str(broken))


@pytest.fixture(scope="module")
def three_ranks(checkpoint, tmp_path_factory) -> list[dict[str, object]]:
    return launch(3, tmp_path_factory.mktemp("three"), "--model", str(checkpoint),
                  "--devices", json.dumps(THREE_CAPACITIES))


@pytest.fixture(params=["two_ranks", "three_ranks"])
def ranks(request) -> list[dict[str, object]]:
    return request.getfixturevalue(request.param)


def test_stages_are_the_split_asked_for(two_ranks, three_ranks):
    expected_two = stage_map(CONFIG, 2, TWO_RANKS)
    assert [expected_two[u] for u in ("embed_tokens", "layers.0", "layers.1", "lm_head")] == [0, 0, 1, 1]
    assert all(r["stages"] == expected_two for r in two_ranks)
    # Every rank computed the same plan as this process does over the same capacities.
    planned = k2lab.plan(CONFIG, THREE_CAPACITIES, format="unquantized", dtype=torch.float32).units
    assert all(r["stages"] == planned for r in three_ranks)
    assert sorted(set(planned.values())) == [0, 1, 2] and planned["layers.2"] == 1


def test_logits_equal_one_process(ranks, reference):
    for r in ranks:
        torch.testing.assert_close(r["logits"], reference["logits"], atol=1e-5, rtol=0)
        assert r["logits"].dtype == torch.float32


def test_cache_of_every_probe_equals_one_process(ranks, reference):
    for r in ranks:
        assert list(r["cache"]) == list(reference["cache"])  # every probe, in firing order
        for name, tensor in reference["cache"].items():
            got = r["cache"][name]
            assert got.dtype == tensor.dtype, name
            torch.testing.assert_close(got, tensor, atol=1e-5, rtol=0, msg=name)
        # The analyses read the gathered cache on every rank, head included.
        for key in ("logit_lens", "attribution"):
            torch.testing.assert_close(r[key], reference[key], atol=1e-5, rtol=0)
        assert torch.equal(r["trace"], reference["trace"])


def test_expert_ablation_equals_one_process(ranks, reference):
    assert (reference["ablated"] - reference["logits"]).abs().max() > 1e-2  # the ablation changes the output
    for r in ranks:
        torch.testing.assert_close(r["ablated"], reference["ablated"], atol=1e-5, rtol=0)


def test_left_padded_batch_equals_one_process(ranks, reference):
    """A padded batch: the mask, and the rotary positions that count real tokens only, reach every stage; at
    generate's prefill the last rank sends the mask, and each rank's latent cache remembers the pads."""
    unpadded = torch.equal(reference["masked_logits"], reference["logits"])
    assert not unpadded and reference["masked_greedy"].shape == (2, 9 + NEW_TOKENS)
    for r in ranks:
        torch.testing.assert_close(r["masked_logits"], reference["masked_logits"], atol=1e-5, rtol=0)
        assert torch.equal(r["masked_greedy"], reference["masked_greedy"])


def test_generation_equals_one_process(ranks, reference):
    for r in ranks:
        assert torch.equal(r["greedy"], reference["greedy"])
        assert torch.equal(r["sampled"], reference["sampled"])  # sampled once, on the last rank
    assert reference["greedy"].shape == (2, 9 + NEW_TOKENS)


def test_bad_generate_arguments_raise_on_every_rank(ranks):
    last = len(ranks) - 1
    assert ranks[last]["generate_error"] == "ValueError: top_p must be None or lie in (0, 1], got 2.0"
    for r in ranks[:last]:
        assert r["generate_error"] == f"RuntimeError: generate failed on rank {last}: ValueError: top_p must be " \
                                      "None or lie in (0, 1], got 2.0"


def test_each_rank_reads_only_its_own_units(ranks, checkpoint):
    weight_map = read_weight_map(checkpoint / "model.safetensors.index.json")
    for rank, r in enumerate(ranks):
        own = {unit for unit, s in r["stages"].items() if s == rank}
        names = [name for name, _ in r["reads"]]
        assert sorted(names) == sorted(n for n in weight_map if unit_of(n) in own)  # each once, all of them
        assert {file for _, file in r["reads"]} == {weight_map[n] for n in names}
        # The other ranks' units stay on meta; the final norm and head are copied to every rank (not read).
        others = {unit for unit, s in r["stages"].items() if s != rank} - {"norm", "lm_head"}
        assert r["meta"] and all(unit_of(name) in others for name in r["meta"])


def test_a_rank_that_fails_to_load_fails_every_rank(two_ranks):
    """Rank 1 finds a shard missing; rank 0 loaded fine, and raises rank 1's error instead of waiting."""
    for r in two_ranks:
        assert r["load_error"].startswith("rank 1 failed to load its stage: FileNotFoundError: shard "
                                          f"{MISSING_SHARD} named by model.safetensors.index.json is missing")


def test_bytes_sent_follow_from_the_shapes(two_ranks):
    """The byte counts the benchmark reports, from the shapes alone. Rank 0 sends the residual [B, T, D] of each
    forward and its probes; rank 1 (the last) the logits, its probes, the head copy and generate's ids."""
    B, T, D, V, n = 2, 9, CONFIG.hidden_size, CONFIG.vocab_size, NEW_TOKENS
    header = 5 * 8  # kind, B, T, attn_impl, whether a mask follows (int64)
    cache = two_ranks[0]["cache"]
    size = lambda names: sum(cache[name].nelement() * cache[name].element_size() for name in names)  # noqa: E731
    on_rank0 = [name for name in cache if name.startswith(("embed_tokens.", "layers.0."))]
    gates = [name for name in cache if ".mlp.gate.hook_" in name and not name.endswith("hook_logits")]
    forwards = 5  # pm(ids), run_with_cache, the routing trace, the ablation, the padded batch
    generates = 3  # greedy, sampled, padded greedy (the one with a bad argument stops before any step)
    steps = (T + (n - 1)) * B  # tokens fed through the pipeline by one generate: the prompt, then n - 1 steps
    assert two_ranks[0]["bytes_sent"] == 4 * (forwards * B * T * D + generates * steps * D) + size(on_rank0)
    per_generate = n * header + steps * 8 + header + 16 + B * (T + n) * 8  # step headers and ids, stop, the result
    assert two_ranks[1]["bytes_sent"] == (4 * (forwards * B * T * V + D + V * D) + size(set(cache) - set(on_rank0))
                                          + size(gates) + generates * per_generate + B * T  # + the padded mask
                                          + header)  # + the error's header


@pytest.mark.parametrize("world, stages, message", [
    (2, {"": 0, "layers.9": 1}, "names no unit"),
    (2, {"": 1, "layers.2": 0}, "forward order"),
    (3, {"": 0, "lm_head": 2}, "forward order"),  # rank 1 holds nothing
    (2, {"": 0, "lm_head": 1}, "final norm and the head"),  # the norm on rank 0, the head on rank 1
    (2, {"embed_tokens": 0}, "places no rank for layers.0"),
    (2, {"": 1.0}, "a rank must be an integer"),
])
def test_stage_map_refuses_what_cannot_run(world, stages, message):
    with pytest.raises(ValueError, match=message):
        stage_map(CONFIG, world, stages)


@pytest.fixture
def one_rank(checkpoint) -> PipelinedK2:
    """The pipeline on a group of one rank in this process (no spawn): rank 0 is also the last."""
    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    with pytest.MonkeyPatch.context() as env:
        for name, value in {"RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)
                            }.items():
            env.setenv(name, value)
        try:
            yield PipelinedK2(checkpoint, dtype=torch.float32)
        finally:
            dist.destroy_process_group()


def test_hooks_take_the_models_selectors_and_refuse_a_backward(one_rank, reference):
    pm, ids = one_rank, token_ids()
    _, cache = pm.run_with_cache(ids, names_filter=["layers.1.hook_resid_post", lambda n: n.endswith("topk_idx")])
    assert list(cache) == ["layers.1.mlp.gate.hook_topk_idx", "layers.1.hook_resid_post",  # in firing order
                           "layers.2.mlp.gate.hook_topk_idx", "layers.3.mlp.gate.hook_topk_idx"]
    for name, tensor in cache.items():
        torch.testing.assert_close(tensor, reference["cache"][name], atol=1e-5, rtol=0, msg=name)
    with pytest.raises(NotImplementedError, match="bwd_hooks: PipelinedK2 runs forward only"):
        with pm.hooks(bwd_hooks=[("hook_resid_post", lambda grad, hook: None)]):
            pass
    with pytest.raises(NotImplementedError, match="incl_bwd: PipelinedK2 runs forward only"):
        pm.run_with_cache(ids, incl_bwd=True)
    with pytest.raises(NotImplementedError, match="incl_bwd: PipelinedK2 runs forward only"):
        pm.run_with_cache(ids, metric=lambda logits: logits.sum())
    with pytest.raises(ValueError, match=r"fwd_hooks takes \(selector, fn\) pairs"):
        with pm.hooks(fwd_hooks=["hook_resid_post"]):
            pass


def test_a_hook_that_runs_the_pipeline_again_is_refused(one_rank, reference):
    pm, ids = one_rank, token_ids()
    with pytest.raises(RuntimeError, match="called from a hook while its own forward is running"):
        with pm.hooks(fwd_hooks=[("layers.2.hook_resid_post", lambda t, hook: pm(ids))]):
            pm(ids)
    torch.testing.assert_close(pm(ids), reference["logits"], atol=1e-5, rtol=0)  # the guard was reset


def test_init_outside_torchrun_names_the_missing_variables(monkeypatch):
    from k2lab.distributed import init

    for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(RuntimeError, match=r"\['RANK', 'WORLD_SIZE', 'MASTER_ADDR', 'MASTER_PORT'\].*torchrun"):
        init()
