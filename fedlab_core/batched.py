"""The batched executor: a round's sampled clients trained together, as one vectorised program.

The loop (:func:`fedlab_core.engine._train_client`) runs one client's :meth:`Algorithm.local_update` after
another. Here, for an algorithm that declares ``batched`` (its local update is :meth:`Algorithm.start`, the
base :meth:`Algorithm.train_local`, then :meth:`Algorithm.finish`), every client in a chunk of the round's
clients takes each optimiser step at once: one ``torch.func.vmap`` of ``grad`` over ``functional_call`` of
the algorithm's own :meth:`Algorithm.loss` (with each client's weights in its :meth:`Algorithm.frozen_models`:
MOON's global and previous models), its :meth:`Algorithm.correct` (FedProx's proximal pull, SCAFFOLD's
control variates) and SGD
with the run's momentum and weight decay, or Adam, written functionally. Nothing of a method is stated twice: the
start, the loss, the gradient correction and the upload are the algorithm's own.

What matches the loop: each client draws its mini-batches with :meth:`Algorithm.batches` (and its training
transform) from its own generator, in the loop's order, so its batches are the loop's batches. The clients of a
chunk with the same kind of optimiser step together, each at its own rates, longest first, one mapped step per
batch position: a batch shorter than the others (a pass's last) is padded with samples whose logits are replaced by
constants of zero cross-entropy and no gradient, and its loss and gradients are rescaled from the padded size to
its real samples (by exactly 1 for a full batch); a client that has run out of batches (unequal shards) steps with
no sample, and keeps its parameters and momentum (weight decay included) and its loss. So a round is as many mapped
steps as its longest client has batches (FedAvg on 30,000 Fashion-MNIST images over 100 Dirichlet(0.5) clients: 23
steps, where grouping the clients by batch shape at each step took 514). Each client's mean loss is summed step by
step in the loop's order. Only the floats differ: vectorised kernels may sum in another order than the loop's (on a
CPU, LeNet-5's parameters agree to about 1e-7 after a few rounds, the losses to about 1e-7 relative), so a run's
:class:`~fedlab_core.runs.RunConfig` says which executor it used and the key tells them apart. Batched runs are
deterministic: the same run gives the same bits. On a GPU a program's step is captured once as a CUDA graph, on the
program's first round, and replayed for each batch position of every round (:class:`_Program`): the same kernels,
so the same bits as launching them one by one, without the launches' cost.

Runs trained together (:func:`fedlab_core.engine.run_together`): the clients of several runs, a grid's rates and
seeds, step together too, each client at its run's rates; each run's numbers are those it has alone (on a GPU
because each mapped step holds a fixed :data:`WIDTH` of clients).

Inputs a client trains beside the model (:meth:`Algorithm.trained_inputs`: DisTrans's offset) are carried
client by client like the optimiser's state and put into the model as its attributes for each step: their
plain SGD step comes first, on the same padded batch with the model fixed and the batch-norm statistics it
would compute dropped, or from the model step's own gradients (joint), as the loop's :meth:`Algorithm.train_step`.

Augmentations that transform a batch without the model (FedRDN, mixup, NaiveMix, normalisation; OT alignment
acts before training) are applied as the batches are drawn, in the loop's order on the client's generator.

A method that steps by a rule of its own (:meth:`Algorithm.step_rule`: pFedMe's proximal steps towards the
client's local copy of the global model, which it carries beside the model, :meth:`Algorithm.carried`) runs that
rule mapped over the clients, each of its gradients from the functional loss, in place of the optimiser's step;
the loop runs the same rule on the workspace model.

A method whose loss draws random numbers (FedFA's coins and noise for its feature maps) draws them per batch
(:meth:`Algorithm.draws`) as the batches are drawn, after each batch's transforms, in the loop's order; they are
padded like the batch and stepped with it. Tensors its loss updates on every batch (FedFA's momentum statistics,
:meth:`Algorithm.carried`) are carried client by client like the optimiser's state, a batch's statistics taken over
its real samples.

Not batched so far (the run trains in the loop, and says so once): methods with a local step of their own (FRAug;
All, one model trained centrally), AdvProp
(its adversarial batch needs the model), models with buffers other than batch norm's, and dropout (it draws from the
global stream per client). Batch norm keeps each client's own running statistics and computes a batch's statistics
over its real samples (:func:`_norm`): the loop's formulas, summed in another order.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.func import functional_call, grad, grad_and_value, vmap

from .algorithms.base import Algorithm, Message, copy_all, mean_loss
from .data.federation import ClientData
from .data.transforms import TRAIN_TRANSFORMS

# clients trained together at most, bounding the memory of their stacked models and batches: on a CPU the gain
# stops early; a GPU needs many clients at once to be busy (LeNet-5 at batch 32: about 1 GB of activations)
CHUNK = {"cpu": 32, "cuda": 1024}
# On a GPU the kernels a mapped step runs depend on its shape, the number of clients in it included, so a client's
# floats would depend on which others step with it (another run's, in runs trained together). There every step
# maps exactly WIDTH clients, padded with copies of the first: a client's numbers depend on its own batches alone.
# On a CPU they do already (measured: runs trained together are the runs trained alone, bit for bit), so a
# step maps the clients it has.
WIDTH = {"cuda": 128}
# On a GPU a mapped step is captured once as a CUDA graph and replayed (:class:`_Program`); False: launched eagerly
GRAPHS = {"cuda": True}
PAD_LOGIT = -1e4  # a padding sample's logits: 0 at its label, this elsewhere (its cross-entropy is exactly 0)


def unsupported(algorithm: Algorithm, model: nn.Module) -> str | None:
    """Why the batched executor cannot train this run's clients, in a few words; None when it can.
    `algorithm.augment` is the run's augmentation (None: none)."""
    if not algorithm.batched:
        return f"{algorithm.name!r} has a local step of its own"
    for method in ("local_update", "train_local", "train_step", "make_optimizer", "batches"):
        if method == "train_step" and own_rule(algorithm):
            continue  # the loop's form of its step rule
        if getattr(type(algorithm), method) is not getattr(Algorithm, method):  # a subclass's, say a lab's
            return f"{algorithm.name!r} has a local step of its own ({method}; padded batches need the base one)"
    if algorithm.augment is not None and not algorithm.augment.batched:
        return f"augmentation {type(algorithm.augment).__name__} acts inside the local step"
    norms = {f"{m}.{b}" for m, mod in model.named_modules() if isinstance(mod, _BatchNorm)
             for b, _ in mod.named_buffers(recurse=False)}
    other = [n for n, _ in model.named_buffers() if n not in norms]
    if other:
        return f"{type(model).__name__} has buffers other than batch norm's ({other[0]}), which are not batched"
    if any(isinstance(m, nn.modules.dropout._DropoutNd) for m in model.modules()):
        return f"{type(model).__name__} has dropout, which draws from the global stream"
    return None


def own_rule(algorithm: Algorithm) -> bool:
    """Whether the method steps by a rule of its own (:meth:`Algorithm.step_rule`: pFedMe's proximal steps) rather
    than by the optimiser."""
    return type(algorithm).step_rule is not Algorithm.step_rule


def _norm(module: _BatchNorm, x: torch.Tensor, real: torch.Tensor, out: dict[str, torch.Tensor], name: str
          ) -> torch.Tensor:
    """`module`'s batch norm in training mode over the real samples of `x` only (`real`: (B,) bool), as
    ``F.batch_norm`` computes it on them: the batch's mean and biased variance per channel normalise every row,
    and the running statistics (the module's, as ``functional_call`` put them, or their values in `out` from an
    earlier pass of the same step: DisTrans's two channels) move towards the mean and the unbiased variance; their
    new values go to `out` under the buffers' names, the module's own are not touched."""
    dims = [0] + list(range(2, x.dim()))
    weight = real.to(x.dtype).view(-1, *[1] * (x.dim() - 1))  # (B, 1, ...)
    count = (real.sum() * (x[0, 0].numel())).clamp(min=1).to(x.dtype)  # real values per channel
    shape = [1, -1] + [1] * (x.dim() - 2)
    mean = (x * weight).sum(dims) / count  # (C,)
    var = ((x - mean.view(shape)) * weight).square().sum(dims) / count
    y = (x - mean.view(shape)) * torch.rsqrt(var.view(shape) + module.eps)
    if module.affine:
        y = y * module.weight.view(shape) + module.bias.view(shape)
    if module.track_running_stats and module.running_mean is not None:  # from this step's earlier pass, if any
        running_mean, running_var, tracked = (out.get(f"{name}.{b}", getattr(module, b)) for b in
                                              ("running_mean", "running_var", "num_batches_tracked"))
        tracked = tracked + 1
        factor = 1.0 / tracked if module.momentum is None else module.momentum
        out[f"{name}.running_mean"] = running_mean * (1 - factor) + mean.detach() * factor
        out[f"{name}.running_var"] = (running_var * (1 - factor)
                                      + (var * count / (count - 1).clamp(min=1)).detach() * factor)
        out[f"{name}.num_batches_tracked"] = tracked
    return y


class _Loss(nn.Module):
    """The algorithm's loss as a module over the workspace model, so that ``functional_call`` can put any
    parameters into the model while :meth:`Algorithm.loss` runs, on a batch padded to full size: the padding's
    logits are replaced (a forward hook) by constants whose cross-entropy is exactly zero and that carry no
    gradient, so the loss is the real samples' summed loss over the full batch size (rescaled in :func:`_stepper`);
    batch norm computes its statistics over the real samples (:func:`_norm`). The loss's client state holds the
    batch's real samples, its draws (:meth:`Algorithm.draws`) and the client's carried tensors that the loss updates
    (:meth:`Algorithm.carried`: FedFA's statistics). Returns the loss and the new values of the batch-norm buffers
    and of those carried tensors (``"carried.<name>"``)."""

    def __init__(self, algorithm: Algorithm):
        super().__init__()
        self.model = algorithm.model
        self.frozen = nn.ModuleDict(algorithm.frozen_models())  # their weights: each client's, from its context
        self.algorithm = algorithm

    def forward(self, x: torch.Tensor, y: torch.Tensor, real: torch.Tensor, inputs: dict[str, torch.Tensor],
                carried: dict[str, torch.Tensor], draws: dict[str, torch.Tensor]
                ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        def pad(module, args, logits):
            if y.is_floating_point():  # soft targets: a zero row's cross-entropy is zero whatever the logits
                return torch.where(real[:, None], logits, logits.detach())
            hit = torch.arange(logits.shape[-1], device=logits.device) == y[:, None]
            return torch.where(real[:, None], logits, torch.where(hit, 0.0, PAD_LOGIT).to(logits.dtype))
        buffers: dict[str, torch.Tensor] = {}
        norms = [(n, m) for n, m in self.model.named_modules() if isinstance(m, _BatchNorm)]
        for n, m in norms:
            m.forward = lambda inp, m=m, n=n: _norm(m, inp, real, buffers, n)
        hook = self.model.register_forward_hook(pad)
        held = {name: getattr(self.model, name) for name in inputs}
        for name, value in inputs.items():  # the trained inputs (DisTrans's offset), as the model's attributes
            setattr(self.model, name, value)
        step = {"real": real, "draws": draws, "carried": dict(carried)}  # the loss puts the carried's new values there
        try:
            loss = self.algorithm.loss(x, y, step)  # reads the model, frozen models, batch and draws
            return loss, {**buffers, **{f"carried.{n}": v for n, v in step["carried"].items()}}
        finally:
            hook.remove()
            for name, value in held.items():
                setattr(self.model, name, value)
            for _, m in norms:
                del m.forward


Task = tuple[Algorithm, ClientData, Message, dict[str, Any], torch.Generator]


def local_updates(tasks: list[Task], chunk: int | None = None) -> list[tuple[bool, Any]]:
    """Each task's ``algorithm.local_update(message, client_state, data, rng)``, as (algorithm, data, message,
    client state, rng), computed `chunk` clients at a time (None: the device's :data:`CHUNK`). The tasks' algorithms may be several runs' (runs
    trained together, :func:`run_together`): one class with the same settings but for the local training's
    rates, each run's workspace model of one architecture. Returns ``(True, (upload, new client state))`` or
    ``(False, exception)`` per task, in order; an error in a chunk's training fails that chunk's clients."""
    if chunk is None and tasks:
        chunk = CHUNK.get(next(tasks[0][0].model.parameters()).device.type, CHUNK["cpu"])
    out = []
    for s in range(0, len(tasks), chunk or 1):
        out += _chunk(tasks[s:s + chunk])
    return out


def _chunk(tasks: list[Task]) -> list[tuple[bool, Any]]:
    """:func:`local_updates` for clients trained together: start each, draw its batches, train all, finish each.
    Each client's starting entries are copied into rows of tensors stacked over the chunk's clients, and its trained
    ones back into the workspace model, each by one fused copy (:func:`copy_all`): on a GPU a few launches a client,
    not one an entry."""
    results: list[Any] = [None] * len(tasks)
    live, contexts, batches = [], [], []
    starts: dict[str, torch.Tensor] = {}  # (clients, ...) by entry: row j is the j-th live client's
    for i, (algorithm, data, message, state, rng) in enumerate(tasks):
        try:
            contexts.append(algorithm.start(message, state))
            entries = _entries(algorithm)
            if not starts:
                starts = {n: v.new_empty((len(tasks), *v.shape)) for n, v in entries.items()}
            copy_all([starts[n][len(live)] for n in entries], list(entries.values()))
            batches.append(_drawn(algorithm, data, rng))
            live.append(i)
        except Exception as err:
            if len(contexts) > len(live):
                contexts.pop()
            results[i] = (False, err)
    if not live:
        return results
    try:
        trained, totals = _train([tasks[i][0] for i in live], {n: v[:len(live)] for n, v in starts.items()},
                                 contexts, batches)
    except Exception as err:
        return [(False, err) if i in live else r for i, r in enumerate(results)]
    for j, i in enumerate(live):
        algorithm, data, message, state, _ = tasks[i]
        try:
            algorithm.start(message, state)  # the client's whole starting model, then its trained entries
            entries = _entries(algorithm)
            copy_all(list(entries.values()), [trained[j][n] for n in entries])
            results[i] = (True, algorithm.finish(data, mean_loss(totals[j], len(batches[j])), state))
        except Exception as err:
            results[i] = (False, err)
    return results


def _entries(algorithm: Algorithm) -> dict[str, torch.Tensor]:
    """What a client's steps change, by name: the workspace model's trained parameters, its buffers and its trained
    inputs (``"input.<name>"``), and the tensors the method carries beside them (``"carried.<name>"``)."""
    model = algorithm.model
    return {**{n: p for n, p in model.named_parameters() if p.requires_grad}, **dict(model.named_buffers()),
            **{f"input.{n}": getattr(model, n) for n in algorithm.trained_inputs()[0]},
            **{f"carried.{n}": t for n, t in algorithm.carried().items()}}


def _drawn(algorithm: Algorithm, data: ClientData, rng: torch.Generator
           ) -> list[tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]]:
    """The client's batches (x, y, the method's draws) as its local update would train on them: the loop's draws in
    the loop's order (a pass's permutation, then each batch's training transform, the augmentation's transform and
    the method's draws, :meth:`Algorithm.draws`)."""
    transform = TRAIN_TRANSFORMS[algorithm.training.train_transform]
    out = []
    for x, y in algorithm.batches(data, rng):
        if transform is not None:
            x = transform(x, rng)
        if algorithm.augment is not None:
            x, y = algorithm.augment.train_batch(algorithm.model, x, y, data.cid, rng)
        out.append((x, y, algorithm.draws(x, y, rng)))
    return out


CARRIED = ("input.", "carried.")  # a client's tensors carried through its steps beside its optimiser's state
RATES = ("lr", "momentum", "weight_decay")  # the local training's rates, which may differ between runs together


def _kind(algorithm: Algorithm) -> tuple[str, bool, bool]:
    """The local optimiser, and whether it has momentum and weight decay: the clients of one mapped program share
    these; their rates (:data:`RATES`) are each client's own, stacked like its parameters."""
    t = algorithm.training
    return t.optimizer, bool(t.momentum), bool(t.weight_decay)


ADAM_BETAS, ADAM_EPS = (0.9, 0.999), 1e-8  # torch.optim.Adam's defaults, which Algorithm.make_optimizer keeps


def _optimiser_state(optimizer: str, momentum: bool, params: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The optimiser's state at a local update's start, stacked like `params`: SGD's momentum buffers (none
    without momentum), Adam's moving averages and its step count (float64, as the bias corrections use it)."""
    zeros = {n: torch.zeros_like(v) for n, v in params.items()}
    if optimizer == "adam":
        first = next(iter(params.values()))
        count = torch.zeros(len(first), dtype=torch.float64, device=first.device)
        return {**{f"m.{n}": v for n, v in zeros.items()}, **{f"v.{n}": v.clone() for n, v in zeros.items()},
                "step": count}
    return {f"m.{n}": v for n, v in zeros.items()} if momentum else {}


def _stepper(algorithm: Algorithm, names: list[str], optimizer: str, momentum: bool, weight_decay: bool,
             draw_names: tuple[str, ...] = ()):
    """One client's optimiser step (torch.optim.SGD's or Adam's arithmetic), mapped over clients: (parameters,
    optimiser state, buffers, correction context, rates (:data:`RATES`, float64), x, y, which samples are real,
    whether the client has a batch at all, then the batch's draws named by `draw_names`) stacked by client, to new
    parameters, optimiser state, buffers and losses. The carried tensors of a method without a step rule of its own
    ride in the optimiser state and take the values its loss gives them (FedFA's statistics). The rates are rounded
    to float32 where SGD uses them, as its Python floats are. A padded batch's loss
    and gradients are rescaled from the full batch size to its real samples (by exactly 1 for a full batch); a
    client without a batch keeps its parameters and optimiser state, weight decay included, and adds nothing to its
    loss. A method with a step rule of its own (:func:`own_rule`) steps by that rule instead of the optimiser, its
    carried tensors in the optimiser state's place."""
    loss_module = _Loss(algorithm)
    beta1, beta2 = ADAM_BETAS

    frozen = tuple(f"{name}." for name in loss_module.frozen)

    input_rates, joint = algorithm.trained_inputs()
    own = own_rule(algorithm)

    def step(p, o, b, context, rates, x, y, real, live, *drawn):
        lr = rates["lr"]
        entries = {f"frozen.{k}": v for k, v in context.items() if k.startswith(frozen)} if frozen else {}
        scale = real.numel() / real.sum().clamp(min=1)
        draws = dict(zip(draw_names, drawn, strict=True))
        carried = {n[len("carried."):]: v for n, v in o.items() if n.startswith("carried.")}
        by_loss = {} if own else carried  # under a step rule the rule moves them, else the loss

        def loss_of(q, inputs, buffers=b):
            return functional_call(loss_module, {**{f"model.{n}": v for n, v in (q | buffers).items()}, **entries},
                                   (x, y, real, inputs, by_loss, draws))

        if own:  # the method's rule, its gradients each from the buffers the previous one left
            held = dict(b)

            def gradient(q):
                grads, (loss, new_b) = grad_and_value(lambda q: loss_of(q, {}, held), has_aux=True)(q)
                held.update({n: torch.where(live, v, held[n]) for n, v in new_b.items()})
                return algorithm.correct({n: g * scale for n, g in grads.items()}, q, context), loss * scale

            new_p, new_c, loss = algorithm.step_rule(p, carried, gradient, lr)
            return ({n: torch.where(live, new_p[n], p[n]) for n in names},
                    {f"carried.{n}": torch.where(live, v, carried[n]) for n, v in new_c.items()}, held,
                    torch.where(live, loss, 0.0))

        def stepped(inputs, grads):  # their plain SGD step; a client without a batch keeps its own
            return {n: torch.where(live, t - input_rates[n] * (grads[n] * scale), t) for n, t in inputs.items()}

        inputs = {n: o[f"input.{n}"] for n in input_rates}
        if inputs and joint:  # from the model step's gradients
            (grads, input_grads), (loss, new_b) = grad_and_value(loss_of, argnums=(0, 1), has_aux=True)(p, inputs)
            inputs = stepped(inputs, input_grads)
        else:
            if inputs:  # a step before the model's, with the model and its statistics fixed (new buffers dropped)
                inputs = stepped(inputs, grad(lambda i: loss_of(p, i)[0])(inputs))
            grads, (loss, new_b) = grad_and_value(lambda q: loss_of(q, inputs), has_aux=True)(p)
        # a client without a batch keeps its own buffers and carried tensors
        new_o = {f"input.{n}": t for n, t in inputs.items()}
        new_o.update({n: torch.where(live, v, o[n]) for n, v in new_b.items() if n.startswith("carried.")})
        new_b = {n: torch.where(live, v, b[n]) for n, v in new_b.items() if not n.startswith("carried.")}
        grads = algorithm.correct({n: g * scale for n, g in grads.items()}, p, context)
        new_p = {}
        if optimizer == "adam":  # the bias corrections in float64, rounded once, as Adam's Python floats are
            count = o["step"] + 1
            step_size = (lr / (1 - beta1 ** count)).float()
            root = (1 - beta2 ** count).sqrt().float()
            new_o["step"] = torch.where(live, count, o["step"])
        for n in names:
            g = grads[n]
            if weight_decay:
                g = torch.addcmul(g, p[n], rates["weight_decay"].float())  # g.add(p, alpha=wd)'s bits
            if optimizer == "adam":
                m, v = torch.lerp(o[f"m.{n}"], g, 1 - beta1), o[f"v.{n}"].mul(beta2).addcmul(g, g, value=1 - beta2)
                new_o[f"m.{n}"], new_o[f"v.{n}"] = (torch.where(live, m, o[f"m.{n}"]),
                                                    torch.where(live, v, o[f"v.{n}"]))
                new_p[n] = torch.where(live, p[n] + (-step_size * m) / (v.sqrt() / root).add(ADAM_EPS), p[n])
                continue
            if momentum:  # the buffer starts at zero: its first step is the gradient, as SGD's clone is
                new_o[f"m.{n}"] = torch.where(live, (o[f"m.{n}"] * rates["momentum"].float()).add(g), o[f"m.{n}"])
                g = new_o[f"m.{n}"]
            new_p[n] = torch.where(live, torch.addcmul(p[n], g, -lr.float()), p[n])  # p.add(g, alpha=-lr)'s
        return new_p, new_o, {**b, **new_b}, torch.where(live, loss * scale, 0.0)

    return vmap(step)


def _calls(algorithms: list[Algorithm], batches: list[list], device: torch.device) -> list[list[int]]:
    """The clients grouped into mapped programs: by their optimiser's kind (:func:`_kind`; a grid's rates step
    together), longest first (so that clients of similar lengths step together and few steps are padding), at most
    :data:`WIDTH` (on a GPU) or all together."""
    width = WIDTH.get(device.type)
    by_kind: dict[tuple, list[int]] = {}
    for c in sorted(range(len(batches)), key=lambda c: -len(batches[c])):
        by_kind.setdefault(_kind(algorithms[c]), []).append(c)
    return [group[i:i + (width or len(group))] for group in by_kind.values()
            for i in range(0, len(group), width or len(group))]


def _stacked(batches: list[list[tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]]], size: int
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """The clients' batches (x, y, draws) as (clients, steps, size, ...) tensors x and y, each batch padded to `size`
    and each client to the most steps, with `real` (clients, steps, size) marking the real samples, and the draws
    (:meth:`Algorithm.draws`) by name, padded alike (zeros): every batch's tensor is concatenated once and copied to
    its place in one indexed copy."""
    steps = max(len(b) for b in batches)
    flat = [batch for client_batches in batches for batch in client_batches]
    lengths = torch.tensor([len(batch[1]) for batch in flat])
    places = torch.tensor([(c * steps + s) * size for c, client_batches in enumerate(batches)
                           for s in range(len(client_batches))])
    # each sample's row: its batch's place, plus its position in the batch
    before = torch.cumsum(lengths, 0) - lengths
    index = (torch.repeat_interleave(places - before, lengths) + torch.arange(int(lengths.sum())))
    x0, y0, draws0 = flat[0]
    index = index.to(x0.device)
    shape = (len(batches), steps, size)

    def padded(parts: list[torch.Tensor]) -> torch.Tensor:
        out = parts[0].new_zeros((len(batches) * steps * size, *parts[0].shape[1:]))
        out.index_copy_(0, index, torch.cat(parts))
        return out.view(*shape, *parts[0].shape[1:])
    real = torch.zeros(len(batches) * steps * size, dtype=torch.bool, device=x0.device)
    real[index] = True
    return (padded([batch[0] for batch in flat]), padded([batch[1] for batch in flat]), real.view(shape),
            {n: padded([batch[2][n] for batch in flat]) for n in sorted(draws0)})


# the programs kept from round to round (:class:`_Program`), the most recently used last; a GPU program holds its
# graph's memory (LeNet-5 at batch 32 on 128 clients: about 1 GB), so only a few are kept
PROGRAMS: dict[tuple, "_Program"] = {}
KEEP = 4


class _Program:
    """A mapped program's tensors, kept from round to round: the carried (parameters, optimiser state, buffers) and
    the `fixed` (the correction context, the rates), stacked over `width` clients, the step's data slots and the
    summed losses. A round copies its values into them (:meth:`run`), so on a GPU its step is captured as a CUDA
    graph once, on the program's first round, and replayed from then on: the same kernels on the same addresses,
    so the same bits as launching them one by one, without the launches' cost (a step launches hundreds of small
    kernels, whose launches cost more than their arithmetic). The capture's warm-up steps have no live client
    (the slots are empty), so they change nothing: a client without a batch keeps its parameters, state and
    buffers, and adds nothing to its loss."""

    def __init__(self, step, carry: tuple[dict[str, torch.Tensor], ...], fixed: tuple[dict[str, torch.Tensor], ...],
                 data: tuple[torch.Tensor, ...], width: int, graphed: bool):
        self.carry = tuple({k: torch.zeros_like(v) for k, v in part.items()} for part in carry)
        self.fixed = tuple({k: torch.zeros_like(v) for k, v in part.items()} for part in fixed)
        self.slots = [t.new_zeros((width, *t.shape[2:])) for t in data]
        self.total = torch.zeros(width, device=data[0].device)
        self.advance = self._advance
        self.step = step
        if graphed:
            self.advance = _captured(self._advance)

    def _advance(self):
        new = self.step(*self.carry, *self.fixed, *self.slots)
        with torch.no_grad():
            for old, values in zip(self.carry, new):
                for k, v in values.items():
                    old[k].copy_(v)
            self.total.add_(new[-1])

    def run(self, carry: tuple[dict[str, torch.Tensor], ...], fixed: tuple[dict[str, torch.Tensor], ...],
            data: tuple[torch.Tensor, ...]) -> tuple[tuple[dict[str, torch.Tensor], ...], torch.Tensor]:
        """Take the steps of `data` (x, y, real, live, then the batches' draws), its `n` real clients' batches step
        by step (clients, steps, ...), from `carry` with `fixed`: each step copies its slice into the slots (the
        padding clients' rows stay empty: no sample, no step). Returns the carried tensors and each client's summed loss, the first `n` rows,
        as new tensors (the program's own are the next round's); the losses on the CPU, copied in one transfer, not
        read client by client (float32 division gives the same bits on either device)."""
        with torch.no_grad():
            for mine, theirs in zip(self.carry + self.fixed, carry + fixed):
                for k, v in theirs.items():
                    mine[k].copy_(v)
            self.total.zero_()
            for slot in self.slots:
                slot.zero_()
        n, steps = data[0].shape[:2]
        for s in range(steps):
            for slot, t in zip(self.slots, data):
                slot[:n].copy_(t[:, s])
            self.advance()
        return (tuple({k: v[:n].clone() for k, v in part.items()} for part in self.carry),
                self.total[:n].to("cpu", copy=True))


def _program(algorithm: Algorithm, names: list[str], kind: tuple, carry: tuple[dict[str, torch.Tensor], ...],
             fixed: tuple[dict[str, torch.Tensor], ...], data: tuple[torch.Tensor, ...], width: int,
             graphed: bool, draw_names: tuple[str, ...] = ()) -> _Program:
    """The program for this call: the one kept from an earlier round when everything its step reads is the same
    (the algorithm object, whose settings its step bakes in, the optimiser's kind, the width, every tensor's name,
    shape and type, and the addresses of the model's and the frozen models' own tensors, which a step reads where
    the stacked ones do not replace them), else a new one. At most :data:`KEEP` are kept, the least recently used
    dropped first; 0 keeps none (every call builds its program, and on a GPU captures it, anew)."""
    shapes = tuple((k, tuple(v.shape), v.dtype) for part in carry + fixed for k, v in part.items())
    modules = [algorithm.model, *algorithm.frozen_models().values()]
    held = tuple(t.data_ptr() for m in modules for t in [*m.parameters(), *m.buffers()])
    key = (id(algorithm), kind, width, graphed, shapes, held, draw_names,
           tuple((tuple(t.shape[2:]), t.dtype, t.device) for t in data))
    program = PROGRAMS.pop(key, None)
    if program is None:
        while PROGRAMS and len(PROGRAMS) >= KEEP:
            PROGRAMS.pop(next(iter(PROGRAMS)))
        program = _Program(_stepper(algorithm, names, *kind, draw_names), carry, fixed, data, width, graphed)
        program.algorithm = algorithm  # held, so that its id stays its own while the program is kept
    if KEEP:
        PROGRAMS[key] = program
    return program


def _captured(fn, warmup: int = 2):
    """`fn` (no arguments, reading and writing only tensors whose addresses stay put) captured as a CUDA graph
    after `warmup` eager calls on a side stream (cuBLAS's and autograd's lazy set-up happens outside the
    capture); returns the graph's replay."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


def _train(algorithms: list[Algorithm], starts: dict[str, torch.Tensor], contexts: list[dict[str, torch.Tensor]],
           batches: list[list[tuple[torch.Tensor, torch.Tensor]]]
           ) -> tuple[list[dict[str, torch.Tensor]], list[torch.Tensor]]:
    """Each client's trained entries (:func:`_entries`) and its summed step losses: every client's optimiser steps
    on its own batches, from its own start (`starts`: each entry stacked over the clients), at its run's rates.
    The clients of one mapped program (:func:`_calls`) take their steps together, every batch padded to the
    largest batch size; on a GPU a program is padded to :data:`WIDTH` clients, copies of its first with no sample
    to train on, whose results are dropped."""
    first = algorithms[0]
    names = [n for n, p in first.model.named_parameters() if p.requires_grad]
    buffer_names = [n for n, _ in first.model.named_buffers()]
    for model in {id(a.model): a.model for a in algorithms}.values():  # each run's model once, not once a client
        model.train()
    device = starts[names[0]].device
    size = max(len(batch[1]) for client_batches in batches for batch in client_batches)
    trained: list[Any] = [None] * len(batches)
    totals: list[Any] = [None] * len(batches)
    for call in _calls(algorithms, batches, device):
        n = len(call)
        x, y, real, drawn = _stacked([batches[c] for c in call], size)
        live = real.any(-1)
        # the padding clients up to the width, copies of the first with no sample, so no step (:meth:`_Program.run`
        # pads step by step, so as to hold only one step of their empty batches)
        call = call + call[:1] * (WIDTH.get(device.type, n) - n)
        rows = torch.tensor(call, device=device)
        kind = _kind(algorithms[call[0]])
        params = {k: starts[k].index_select(0, rows) for k in names}
        buffers = {k: starts[k].index_select(0, rows) for k in buffer_names}
        rates = {k: torch.tensor([float(getattr(algorithms[c].training, k) or 0.0) for c in call],
                                 dtype=torch.float64, device=device) for k in RATES}
        state = {**({} if own_rule(first) else _optimiser_state(kind[0], kind[1], params)),
                 **{k: v.index_select(0, rows) for k, v in starts.items() if k.startswith(CARRIED)}}
        context = {k: torch.stack([contexts[c][k] for c in call]) for k in contexts[0]}
        carry, fixed, data = (params, state, buffers), (context, rates), (x, y, real, live, *drawn.values())
        program = _program(first, names, kind, carry, fixed, data, len(call), GRAPHS.get(device.type, False),
                           tuple(drawn))
        (params, state, buffers), total = program.run(carry, fixed, data)
        for j, c in enumerate(call[:n]):
            trained[c] = {k: v[j] for k, v in (params | buffers).items()}
            trained[c].update({k: v[j] for k, v in state.items() if k.startswith(CARRIED)})
            totals[c] = total[j]
    return trained, totals
