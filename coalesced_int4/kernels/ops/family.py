"""``QuantizedGemmFamily``: one ``torch.library.triton_op`` per M bucket, with validation.

A family is a GEMM offered at several row counts (buckets). For each bucket ``b`` it registers
``torch.ops.<namespace>.<name>_m<b>`` whose schema is the prototype's signature; the op
validates its arguments, then launches. Under torch.compile / AOTInductor the op is traced
into its Triton launches (``wrap_triton``), so the kernels are compiled into the generated
code; its fake kernel returns an empty bf16 ``(M, N)`` with M symbolic when it is.

Each op's ``kernels(b)`` (the Triton kernels its launches may run) are recorded with torch as
the kernels of that op: torch finds a ``triton_op``'s kernels by reading its function's source,
which here reaches them only through the launcher, and AOTAutograd's cache keys a graph that
calls the op on those kernels' sources (with every Triton function they call). A graph that
reaches the ops through a quantized weight is keyed by the weight instead, which brings the
package's source hash (``coalesced_int4.source_hash``) into the key.

``supports(b, *args)`` never raises; ``validate(b, *args)`` raises
``RuntimeError("<name>_m<b>: <reason>")``; ``op(b)`` for an unknown bucket raises
``RuntimeError("unsupported <name> bucket <b>; expected one of <buckets>")``.
"""

from __future__ import annotations

import inspect
import typing
from typing import Callable, Dict, Optional, Sequence

import torch
import triton
from torch.library import triton_op, wrap_triton

from coalesced_int4.torch_internals import is_wrap_triton_enabled, triton_ops_registry

NAMESPACE = "coalesced_int4"


INTERPRETER = bool(triton.knobs.runtime.interpret)
"""Triton runs kernels in its interpreter (``TRITON_INTERPRET=1``, fixed when Triton decorates
them): kernels take their ``INTERPRET`` paths (no inline asm, bf16 math in fp32)."""


def launchable(kernel):
    """What a launch calls: ``wrap_triton(kernel)`` while tracing (looked up here at each
    launch, so tests can patch it), else ``kernel`` itself, which is what ``wrap_triton``
    returns then; torch 2.11's ``wrap_triton`` refuses the interpreter's kernels even so."""
    return wrap_triton(kernel) if is_wrap_triton_enabled() else kernel


class QuantizedGemmFamily:
    def __init__(
        self,
        name: str,
        buckets: Sequence[int],
        prototype: Callable,
        launch: Callable,
        fake: Callable,
        unsupported_reason: Callable[..., Optional[str]],
        kernels: Callable[[int], Sequence[object]],
    ):
        if not buckets or any(b < 1 for b in buckets) or len(set(buckets)) != len(buckets):
            raise ValueError(f"buckets must be distinct positive row counts, got {tuple(buckets)}")
        self.name = name
        self.buckets = tuple(sorted(buckets))
        self._launch = launch
        self._fake = fake
        self._unsupported_reason = unsupported_reason
        self._kernels = kernels
        hints = typing.get_type_hints(prototype)  # resolves postponed (string) annotations
        signature = inspect.signature(prototype)
        self._signature = signature.replace(
            parameters=[p.replace(annotation=hints[p.name]) for p in signature.parameters.values()],
            return_annotation=hints["return"],
        )
        self._annotations = hints
        self._ops: Dict[int, object] = {b: self._register(b) for b in self.buckets}

    def _register(self, bucket: int):
        family = self

        def impl(*args):
            family.validate(bucket, *args)
            return family._launch(bucket, *args)

        def fake(*args):
            return family._fake(bucket, *args)

        for function, name in ((impl, f"{self.name}_m{bucket}"), (fake, f"_{self.name}_m{bucket}_fake")):
            function.__name__ = function.__qualname__ = name
            function.__signature__ = self._signature
            function.__annotations__ = self._annotations
        qualified_name = f"{NAMESPACE}::{self.name}_m{bucket}"
        op = triton_op(qualified_name, mutates_args=())(impl)
        op.register_fake(fake)
        # torch's own record of each triton_op's kernels (internal; a torch without it has
        # nothing to record them in).
        registry = getattr(triton_ops_registry, "triton_ops_to_kernels", None)
        if registry is not None:
            registry[qualified_name] = list(self._kernels(bucket))
        return getattr(torch.ops, NAMESPACE).__getattr__(f"{self.name}_m{bucket}")

    def _check_bucket(self, bucket: int) -> None:
        if bucket not in self._ops:
            raise RuntimeError(
                f"unsupported {self.name} bucket {bucket}; expected one of {self.buckets}"
            )

    def op(self, bucket: int):
        self._check_bucket(bucket)
        return self._ops[bucket]

    def supports(self, bucket: int, *args) -> bool:
        return bucket in self._ops and self._unsupported_reason(bucket, *args) is None

    def validate(self, bucket: int, *args) -> None:
        self._check_bucket(bucket)
        reason = self._unsupported_reason(bucket, *args)
        if reason is not None:
            raise RuntimeError(f"{self.name}_m{bucket}: {reason}")
