"""The stacked task models behind model.batch_tasks (mima.models.stacked), against the same task
models trained one after another on the same batches.

Each check builds the small CLIP's image tower, makes L different task models of it, and runs them
both ways: stacked (one vmap'ed forward over [L, B] images, one AdamW over the stacked tensors,
per-task clipping) and separately (L encoders, L AdamWs, torch's clip_grad_norm_ each).
"""

from __future__ import annotations

import copy

import open_clip
import pytest
import torch
import torch.nn.functional as F

from mima.models.stacked import StackedEncoder, clip_per_task, per_task_norms

COPIES, BATCH, CLASSES = 3, 8, 5
# Batched matrix products sum in another order than separate ones. AdamW divides each gradient entry by
# its own running scale, so a rounding difference in a near-zero entry can move that entry by up to
# lr: after 6 steps at lr 1e-3 the stacked task models differ from the separate ones by at most 1.7e-3
# of the task vector's norm (measured on the CPU, 2026-11-28; the same size as torch.compile's, see
# tests/training/test_compile.py). The bound, 1 %, is far below what one task's batch going to another gives.
RELATIVE_TOLERANCE = 1e-2


@pytest.fixture(scope="module")
def tower(small_clip):
    encoder = open_clip.create_model(small_clip).visual
    return encoder.train().requires_grad_(True)


def _task_models(tower) -> list[torch.nn.Module]:
    """COPIES different task models: the tower with a different small perturbation each."""
    models = []
    for index in range(COPIES):
        model = copy.deepcopy(tower)
        generator = torch.Generator().manual_seed(index)
        with torch.no_grad():
            for param in model.parameters():
                param.add_(1e-2 * torch.randn(param.shape, generator=generator))
        models.append(model)
    return models


def _stack(models, tower) -> StackedEncoder:
    stack = StackedEncoder(tower, COPIES)
    for index, model in enumerate(models):
        stack.load_copy(index, model.state_dict())
    return stack


def _data(tower, seed: int = 0):
    size = tower.image_size[0] if isinstance(tower.image_size, tuple) else tower.image_size
    generator = torch.Generator().manual_seed(seed)
    images = torch.randn(COPIES, BATCH, 3, size, size, generator=generator)
    labels = torch.randint(0, CLASSES, (COPIES, BATCH), generator=generator)
    heads = torch.randn(COPIES, CLASSES, tower.output_dim, generator=generator)
    return images, labels, heads


def _loss(features: torch.Tensor, head: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(F.normalize(features, dim=-1) @ head.T, labels)


def test_the_stacked_forward_is_each_task_models_forward(tower):
    models = _task_models(tower)
    stack = _stack(models, tower)
    images, _, _ = _data(tower)
    stacked = stack(images)
    for index, model in enumerate(models):
        alone = model(images[index])
        assert stacked[index].shape == alone.shape
        assert torch.allclose(stacked[index], alone, rtol=1e-5, atol=1e-6), index


def test_per_task_clipping_is_torchs_clipping_of_each_task_model(tower):
    models = _task_models(tower)
    stack = _stack(models, tower)
    images, labels, heads = _data(tower)
    features = stack(images)
    sum(_loss(features[t], heads[t], labels[t]) for t in range(COPIES)).backward()
    expected_norms = []
    for index, model in enumerate(models):
        _loss(model(images[index]), heads[index], labels[index]).backward()
        expected_norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)))
    assert min(expected_norms) > 0.05  # every task is clipped
    norms = clip_per_task(list(stack.parameters()), 0.05)
    assert norms.tolist() == pytest.approx(expected_norms, rel=1e-5)
    for index, model in enumerate(models):
        for name, param in model.named_parameters():
            stacked_grad = stack.stacked[name.replace(".", "/")].grad[index]
            assert torch.allclose(stacked_grad, param.grad, rtol=1e-4, atol=1e-8), (index, name)
    assert per_task_norms(list(stack.parameters())).tolist() == pytest.approx([0.05] * COPIES, rel=1e-4)


def test_adamw_on_the_stack_trains_each_task_model_as_its_own_adamw(tower):
    models = _task_models(tower)
    starts = [copy.deepcopy(model.state_dict()) for model in models]
    stack = _stack(models, tower)
    stacked_optimizer = torch.optim.AdamW(stack.parameters(), lr=1e-3, weight_decay=0.1)
    optimizers = [torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1) for model in models]
    for step in range(6):
        images, labels, heads = _data(tower, seed=step)
        features = stack(images)
        sum(_loss(features[t], heads[t], labels[t]) for t in range(COPIES)).backward()
        clip_per_task(list(stack.parameters()), 1.0)
        stacked_optimizer.step()
        stacked_optimizer.zero_grad()
        for index, (model, optimizer) in enumerate(zip(models, optimizers)):
            _loss(model(images[index]), heads[index], labels[index]).backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad()
    for index, model in enumerate(models):
        trained = {name: value.detach() for name, value in model.state_dict().items()}
        names = [name for name, _ in model.named_parameters()]
        tau = torch.cat([(trained[name] - starts[index][name]).flatten() for name in names])
        gap = torch.cat([(stack.copy_state(index)[name].detach() - trained[name]).flatten() for name in names])
        assert float(tau.norm()) > 1e-3  # it trained
        assert float(gap.norm()) <= RELATIVE_TOLERANCE * float(tau.norm()), (index, float(gap.norm() / tau.norm()))


def test_loading_every_copy_and_one_copy_in_place(tower):
    stack = StackedEncoder(tower, COPIES)
    pointers = [param.data_ptr() for param in stack.parameters()]
    start = {name: value + 1.0 for name, value in tower.state_dict().items()}
    stack.load_every_copy(start)
    for index in range(COPIES):
        assert all(torch.equal(value, start[name]) for name, value in stack.copy_state(index).items())
    other = {name: value - 1.0 for name, value in tower.state_dict().items()}
    stack.load_copy(1, other)
    assert all(torch.equal(value, other[name]) for name, value in stack.copy_state(1).items())
    assert all(torch.equal(value, start[name]) for name, value in stack.copy_state(2).items())
    assert [param.data_ptr() for param in stack.parameters()] == pointers  # in place: optimiser and compile see them
