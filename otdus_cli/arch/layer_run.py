"""One decoder layer of a tiny model watched while the whole model runs on fixed token ids.

The zero-init proof (arch/identity.py) sets some of a layer's tensors to values (0, or 1 for a scale),
runs the model and asks whether the layer handed on exactly what it was handed: its hidden states, and
the other states the layer before hands it (Zaya's router states). Where it did not, one more run tells
why in words a user can act on: the output comes out of a norm (post-norm), the residual path scales or
mixes the stream, or a sublayer adds its own input back.
"""

from __future__ import annotations

from otdus_cli.arch.identity_values import IdentityValue, value_tensor

# config fields added to every weight of a hyper-connection's stream-mixing matrix (after its softmax, in
# each Sinkhorn step: DeepSeek V4's hc_eps), so that no weight setting makes the matrix the identity
MIX_FLOORS = ("hc_eps",)


def stored_buffers(module) -> dict:
    """The floating-point buffers of ``module`` its checkpoint stores (persistent ones), by name."""
    stored = module.state_dict(keep_vars=True)
    return {n: b for n, b in module.named_buffers() if n in stored and b.is_floating_point()}


def is_norm(module) -> bool:
    import torch

    norms = (torch.nn.LayerNorm, torch.nn.GroupNorm, torch.nn.RMSNorm)
    return isinstance(module, norms) or "norm" in type(module).__name__.lower()


def _hidden_of(args: tuple, kwargs: dict):
    """A layer call's hidden states: its first tensor argument, else the ``hidden_states`` keyword."""
    import torch

    first = next((a for a in args if isinstance(a, torch.Tensor)), None)
    return first if first is not None else kwargs.get("hidden_states")


class LayerRun:
    """The model run on fixed ids with some of one layer's tensors set; the layer's input and output:
    its hidden states, and the other states the layer before hands it (Zaya's router states), which a
    layer must hand on unchanged as well to be an identity."""

    def __init__(self, model, layers: list, index: int, ids) -> None:
        self.model, self.layer, self.ids = model, layers[index], ids
        # the pair of layers whose hand-over shows which states a layer carries: this one and the one
        # before; for the first (handed its states by the model: Reformer's two streams), it and the next
        following = layers[min(1, len(layers) - 1)]
        self.pair = (layers[index - 1], self.layer) if index else (self.layer, following)
        self.buffers = stored_buffers(self.layer)
        self.params = {**dict(self.layer.named_parameters()), **self.buffers}
        self.shapes = {n: tuple(p.shape) for n, p in self.params.items()}
        self._calls: dict[str, int] = {}
        self._seen: dict = {}
        self._carried: list[tuple[int, int | str]] | None = None

    def order(self, module: str) -> int:
        """When the layer first runs ``module`` (-1: never, so it cannot matter), from one hooked run."""
        if not self._calls:

            def seen(name: str):
                def hook(_module, _args) -> None:
                    self._calls.setdefault(name, len(self._calls))

                return hook

            hooks = [m.register_forward_pre_hook(seen(name)) for name, m in self.layer.named_modules()]
            try:
                self.identity({})
            finally:
                for hook in hooks:
                    hook.remove()
        return self._calls.get(module, -1)

    def carried(self) -> list[tuple[int, int | str]]:
        """The states besides the hidden states that the layer before hands this one, as (their place in
        a layer's output, where this layer takes them: an argument's position or keyword): the tensors
        the layer before returns that this one is called with (for the first layer: that it returns and
        the next is called with), found in one run."""
        if self._carried is None:
            import torch

            returned: dict[int, tuple[int, torch.Tensor]] = {}  # the tensors kept: their ids stay unique
            found: list[tuple[int, int | str]] = []

            def handed(_module, _args, output) -> None:
                if isinstance(output, tuple | list):
                    returned.update({id(t): (k, t) for k, t in enumerate(output) if k and torch.is_tensor(t)})

            def called(_module, args, kwargs) -> None:
                places = [*enumerate(args), *kwargs.items()]
                found.extend((returned[id(t)][0], where) for where, t in places if id(t) in returned)

            given: set[int | str] = set()  # where this layer is handed a tensor (the first: by the model)

            def handed_here(_module, args, kwargs) -> None:
                given.update(where for where, t in [*enumerate(args), *kwargs.items()] if torch.is_tensor(t))

            before, after = self.pair
            hooks = [self.layer.register_forward_pre_hook(handed_here, with_kwargs=True)]
            if before is not after:
                hooks.append(after.register_forward_pre_hook(called, with_kwargs=True))
                hooks.append(before.register_forward_hook(handed))
            try:
                with torch.no_grad():
                    self.model(input_ids=self.ids, use_cache=False)
            finally:
                for hook in hooks:
                    hook.remove()
            self._carried = [(k, where) for k, where in found if where in given]
        return self._carried

    def widths(self) -> set[int]:
        """The widths of the states the layer reads and hands on: its hidden states' (an embedding may
        be narrower: ELECTRA), the hidden width where those are several streams of it, and those of the
        other states it is handed."""
        if not self._seen:
            self.identity({})
        stream = self._seen["in"].shape[-1]
        widths = {stream, *(t.shape[-1] for t in self._seen["states in"])}
        # a stream of several streams of the hidden width side by side (hyper-connections: Qwen4-Exp's
        # hc_count streams) is written through maps into the hidden width, which the layer mixes in
        hidden = getattr(self.model.config.get_text_config(), "hidden_size", None)
        if isinstance(hidden, int) and 0 < hidden < stream and stream % hidden == 0:
            widths.add(hidden)
        return widths

    def identity(self, targets: dict[str, IdentityValue], states: bool = True) -> bool:
        """Whether the layer hands on what it is handed (its hidden states, and unless not ``states`` the
        other states it is handed) with each of ``targets`` set to its value."""
        import torch

        seen, carried = self._seen, self.carried()

        def before(_module, args, kwargs):
            seen["in"] = _hidden_of(args, kwargs).detach().clone()
            given = {**dict(enumerate(args)), **kwargs}
            seen["states in"] = [given[where].detach().clone() for _, where in carried]

        def after(_module, _args, _kwargs, output):
            seen["out"] = (output[0] if isinstance(output, tuple | list) else output).detach().clone()
            seen["states out"] = [output[k].detach().clone() for k, _ in carried]

        saved = {n: self.params[n].detach().clone() for n in targets}
        hooks = [
            self.layer.register_forward_pre_hook(before, with_kwargs=True),
            self.layer.register_forward_hook(after, with_kwargs=True),
        ]
        try:
            with torch.no_grad():
                for n, value in targets.items():
                    self.params[n].copy_(value_tensor(value, tuple(self.params[n].shape), self.shapes))
                self.model(input_ids=self.ids, use_cache=False)
        finally:
            for hook in hooks:
                hook.remove()
            with torch.no_grad():
                for n, value in saved.items():
                    self.params[n].copy_(value)
        pairs = [(seen["in"], seen["out"]), *zip(seen["states in"], seen["states out"], strict=True)]
        pairs = pairs if states else pairs[:1]
        return all(a.shape == b.shape and torch.equal(a, b) for a, b in pairs)

    def why_not(self, targets: dict[str, IdentityValue]) -> str:
        """Why the layer is no identity with ``targets`` set, as one run shows it: its output comes out
        of a norm (post-norm), or is its input scaled, or else changed otherwise."""
        import torch

        outputs: list[tuple[str, object, torch.Tensor]] = []

        def keep(name: str, module):
            def hook(_module, _args, output) -> None:
                out = output[0] if isinstance(output, tuple | list) else output
                if isinstance(out, torch.Tensor):
                    outputs.append((name, module, out.detach().clone()))

            return hook

        hooks = [m.register_forward_hook(keep(n, m)) for n, m in self.layer.named_modules() if n]
        try:
            self.identity(targets)
        finally:
            for hook in hooks:
                hook.remove()
        x, y = self._seen["in"], self._seen["out"]
        norm = next(
            (n for n, m, out in outputs if is_norm(m) and out.shape == y.shape and torch.equal(out, y)), None
        )
        if norm is not None:
            return (
                f"its output is then that of {norm}, a norm on the residual stream itself (post-norm: "
                "output = norm(x + f(x)); or a residual taken after a norm), which no zeroing makes an "
                "identity"
            )
        if x.shape == y.shape and x.dim() == 4 and _mixes_streams(x, y):
            text = self.model.config.get_text_config()
            values = {n: getattr(text, n, None) for n in MIX_FLOORS}
            floors = [f"{n}={v:g}" for n, v in values.items() if isinstance(v, float) and v > 0]
            never = ""
            if floors:
                never = f": the config's {floors[0]} is added to every weight of M, so it never is"
            return (
                f"its residual path mixes the {x.shape[2]} parallel streams it carries (output = M x for "
                f"each token, M computed from x: hyper-connections), and M is not the identity{never}"
            )
        if x.shape == y.shape and x.dim() >= 2 and bool((x != 0).all()):
            scale = y[..., :1, :] / x[..., :1, :]
            if torch.allclose(y, x * scale, rtol=1e-5, atol=1e-6):
                a = scale.flatten()[0]
                if torch.allclose(scale, a, rtol=1e-6, atol=0):  # one number: no tensor of the layer holds it
                    return (
                        f"its residual path multiplies the hidden state by a = {a.item():.6g}, the same for "
                        "every token and feature: a constant of transformers' code for the layer at this "
                        "index (Beam: sqrt((k - 1) / k) at its k-th residual add), which no weight setting "
                        "makes 1"
                    )
                return (
                    "its residual path multiplies the hidden state by factors other than 1 (output = a * x), "
                    "which neither zeroing nor setting to 1 a scale of the layer (a vector transformers "
                    "initialises to ones) undoes"
                )
        # a sublayer that still outputs something with its tensors zeroed adds back its own input
        # (Gemma 3n's LAuReL block: normed input + linear_right(linear_left(...)))
        kept = next(
            (
                (n, m)
                for n, m, out in outputs
                if any(t.startswith(n + ".") for t in targets) and not is_norm(m) and bool(out.any())
            ),
            None,
        )
        if kept is not None:
            return (
                f"with its tensors zeroed, {kept[0]} ({type(kept[1]).__name__}) still outputs more than zero "
                "(it adds its own input back: a residual branch of its own), which enters the residual stream"
            )
        return "its residual path itself changes the hidden state (more than the tensors that write into it)"


def _mixes_streams(x, y) -> bool:
    """Whether ``y`` mixes the parallel streams of ``x`` (batch, tokens, streams, width): for each token,
    y = M^T x for some streams x streams matrix M, to float32 precision."""
    import torch

    xs, ys = x.double().flatten(0, 1).transpose(1, 2), y.double().flatten(0, 1).transpose(1, 2)
    mix = torch.linalg.lstsq(xs, ys).solution
    return torch.allclose(xs @ mix, ys, rtol=1e-5, atol=1e-6)
