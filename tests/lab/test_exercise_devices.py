"""The exercises' checks on a GPU (issue #43): a learner's function gets the ids on the model's device, and its answer
is compared with k2lab's wherever either was computed. Only a second device shows this, so these run on CUDA alone."""

from __future__ import annotations

import pytest
import torch

from k2lab import K2Config, K2Model
from k2lab.lab import exercises as ex

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.fixture(scope="module")
def gpu_model() -> K2Model:
    model = K2Model(K2Config.mini().replace(num_hidden_layers=2, vocab_size=64, bos_token_id=None,
                                            eos_token_id=None))
    model.init_weights(std=0.2, seed=0)
    return model.eval().cuda()


def greedy(model: K2Model, ids: torch.Tensor, n: int) -> torch.Tensor:
    """The notebook's solution: it appends the model's argmax (on the model's device) to the ids it was given."""
    for _ in range(n):
        next_id = model(ids)[:, -1].argmax(-1, keepdim=True)  # [1, 1]
        ids = torch.cat([ids, next_id], dim=1)
    return ids


@pytest.mark.parametrize("ids_device", ["cpu", "cuda"])
def test_check_greedy_on_a_gpu_model(gpu_model, ids_device):
    ids = torch.tensor([[1, 2, 3, 4]], device=ids_device)
    with torch.no_grad():
        assert ex.check_greedy(greedy, gpu_model, ids).ok
        assert ex.check_greedy(lambda m, i, n: greedy(m, i, n).cpu(), gpu_model, ids).ok  # answered on the CPU
        wrong = ex.check_greedy(lambda m, i, n: greedy(m, i, n)[:, i.shape[1]:], gpu_model, ids)
    assert not wrong.ok and "only the new tokens" in wrong.message


def test_answers_on_the_gpu_are_compared_with_cpu_references():
    def rms_norm(x, weight, eps):
        x, weight = x.cuda(), weight.cuda()
        return x / (x.pow(2).mean(-1, keepdim=True) + eps).sqrt() * weight

    def router(x, weight, bias, top_k, scaling):
        s = (x.cuda() @ weight.cuda().T).sigmoid()
        idx = (s + bias.cuda()).topk(top_k, dim=-1).indices
        w = s.gather(-1, idx)
        return idx, w / w.sum(-1, keepdim=True) * scaling

    assert ex.check_rms_norm(rms_norm).ok
    assert not ex.check_rms_norm(lambda x, w, eps: rms_norm(x, w, 0.0)).ok  # a mistake is still found
    assert ex.check_router(router).ok
