"""Observers: modules that watch the values flowing through a graph and choose quantization
parameters from them.

An observer is an ``nn.Module`` that returns its input unchanged and records statistics;
:func:`~symtrace.passes.quant.insert_observers` puts one after every value that will be
quantized, so calibration is simply running the prepared module on sample data.

* :class:`MinMaxObserver` -- running minimum and maximum.
* :class:`MovingAverageMinMaxObserver` -- exponential moving average of per-batch min/max
  (less sensitive to one outlier batch).
* :class:`PerChannelSymmetricObserver` -- per output channel ``max|w|``, int8, zero point 0
  (for weights).
* :class:`HistogramObserver` -- a histogram of the values; the range is the one minimising the
  L2 quantization error over candidate clippings.
* :class:`PercentileObserver` -- the range between two percentiles (clips rare outliers).
* :class:`FixedQParamsObserver` -- fixed parameters (outputs of sigmoid/tanh).

Every observer has ``qparams()`` -> :class:`~symtrace.passes.quant.qparams.QParams` and
``describe()`` -> a dict for tables.
"""
from __future__ import annotations

from typing import Any, Dict

import torch
from torch import nn

from .qparams import QParams, choose_qparams, qrange

__all__ = ["Observer", "MinMaxObserver", "MovingAverageMinMaxObserver", "PerChannelSymmetricObserver",
           "PerTensorSymmetricObserver", "HistogramObserver", "PercentileObserver", "FixedQParamsObserver"]


class Observer(nn.Module):
    """Base class: identity ``forward`` that records statistics while ``enabled``."""

    def __init__(self, dtype: torch.dtype = torch.uint8, symmetric: bool = False, reduce_range: bool = False):
        super().__init__()
        qrange(dtype)  # validates the dtype
        self.dtype = dtype
        self.symmetric = symmetric
        self.reduce_range = reduce_range
        self.enabled = True
        self.register_buffer("min_val", torch.tensor(float("inf")))
        self.register_buffer("max_val", torch.tensor(float("-inf")))
        self.register_buffer("count", torch.tensor(0, dtype=torch.int64))

    def forward(self, x):
        if self.enabled and isinstance(x, torch.Tensor) and x.is_floating_point() and x.numel():
            with torch.no_grad():
                self.observe(x.detach())
                self.count += 1
        return x

    def observe(self, x: torch.Tensor) -> None:
        raise NotImplementedError

    @property
    def calibrated(self) -> bool:
        return bool(self.count.item() > 0)

    def range(self):
        """``(min, max)`` the parameters are chosen for."""
        return self.min_val, self.max_val

    def qparams(self) -> QParams:
        if not self.calibrated:
            raise RuntimeError(f"{type(self).__name__} has seen no data: run calibration (call the prepared "
                               "module on sample inputs) before converting")
        mn, mx = self.range()
        return choose_qparams(mn, mx, self.dtype, self.symmetric, self.reduce_range)

    def describe(self) -> Dict[str, Any]:
        mn, mx = self.range() if self.calibrated else (float("nan"), float("nan"))
        return {"observer": type(self).__name__, "min": float(mn), "max": float(mx)}

    def extra_repr(self) -> str:
        bits = getattr(self, "bits", 8)
        return (f"dtype={self.dtype}, symmetric={self.symmetric}, reduce_range={self.reduce_range}"
                + (f", bits={bits}" if bits != 8 else ""))


class MinMaxObserver(Observer):
    """Running minimum and maximum over everything seen."""

    def observe(self, x):
        mn, mx = torch.aminmax(x)
        self.min_val = torch.minimum(self.min_val, mn.float())
        self.max_val = torch.maximum(self.max_val, mx.float())


class MovingAverageMinMaxObserver(Observer):
    """Exponential moving average of each batch's min/max: ``m <- m + c * (batch - m)``."""

    def __init__(self, averaging_constant: float = 0.01, **kw):
        super().__init__(**kw)
        if not 0.0 < averaging_constant <= 1.0:
            raise ValueError(f"averaging_constant must be in (0, 1], got {averaging_constant}")
        self.averaging_constant = averaging_constant

    def observe(self, x):
        mn, mx = torch.aminmax(x)
        if self.count.item() == 0:
            self.min_val, self.max_val = mn.float(), mx.float()
        else:
            c = self.averaging_constant
            self.min_val = self.min_val + c * (mn.float() - self.min_val)
            self.max_val = self.max_val + c * (mx.float() - self.max_val)


class PerChannelSymmetricObserver(Observer):
    """Per-channel (``axis``) symmetric int8 parameters from ``max|x|``, zero point 0, levels
    -127..127 (narrow range: -128 never appears, which some int8 kernels need). ``bits`` < 8
    uses fewer levels (4 bits: -7..7), still stored as int8."""

    def __init__(self, axis: int = 0, dtype: torch.dtype = torch.int8, narrow: bool = True, bits: int = 8):
        super().__init__(dtype=dtype, symmetric=True)
        qrange(dtype, narrow=narrow, bits=bits)  # validates bits
        self.axis = axis
        self.narrow = narrow
        self.bits = bits

    def observe(self, x):
        dims = [d for d in range(x.dim()) if d != self.axis % x.dim()]
        mn = x.amin(dim=dims) if dims else x
        mx = x.amax(dim=dims) if dims else x
        if self.count.item() == 0 or self.min_val.dim() == 0:
            self.min_val, self.max_val = mn.float(), mx.float()
        else:
            self.min_val = torch.minimum(self.min_val, mn.float())
            self.max_val = torch.maximum(self.max_val, mx.float())

    def qparams(self) -> QParams:
        if not self.calibrated:
            raise RuntimeError("PerChannelSymmetricObserver has seen no data")
        return choose_qparams(self.min_val, self.max_val, self.dtype, symmetric=True, narrow=self.narrow,
                              axis=self.axis, bits=getattr(self, "bits", 8))

    def describe(self):
        return {"observer": type(self).__name__, "min": float(self.min_val.min()), "max": float(self.max_val.max())}


class PerTensorSymmetricObserver(MinMaxObserver):
    """One symmetric int8 scale for the whole tensor (weights, when per-channel is not wanted);
    ``bits`` as for :class:`PerChannelSymmetricObserver`."""

    def __init__(self, dtype: torch.dtype = torch.int8, narrow: bool = True, bits: int = 8):
        super().__init__(dtype=dtype, symmetric=True)
        qrange(dtype, narrow=narrow, bits=bits)  # validates bits
        self.narrow = narrow
        self.bits = bits

    def qparams(self) -> QParams:
        if not self.calibrated:
            raise RuntimeError("PerTensorSymmetricObserver has seen no data")
        return choose_qparams(self.min_val, self.max_val, self.dtype, symmetric=True, narrow=self.narrow,
                              bits=getattr(self, "bits", 8))


class HistogramObserver(Observer):
    """A fixed-width histogram over the running range; ``qparams`` picks the clipping range
    ``[lo, hi]`` (bin edges) with the least expected L2 error, counting rounding noise inside
    (``step^2 / 12`` per value) and clipping error outside. When a new batch widens the range
    the old counts are re-binned proportionally."""

    def __init__(self, bins: int = 1024, candidates: int = 48, **kw):
        super().__init__(**kw)
        if bins < 16:
            raise ValueError(f"bins must be >= 16, got {bins}")
        self.bins = bins
        self.candidates = candidates
        self.register_buffer("histogram", torch.zeros(bins, dtype=torch.float64))

    def observe(self, x):
        mn, mx = torch.aminmax(x)
        mn, mx = min(float(mn), 0.0), max(float(mx), 0.0)
        if self.count.item() == 0:
            lo, hi = mn, mx
        else:
            lo, hi = min(mn, float(self.min_val)), max(mx, float(self.max_val))
            if lo < float(self.min_val) or hi > float(self.max_val):
                self.histogram = self._rebin(self.histogram, float(self.min_val), float(self.max_val), lo, hi)
        if hi <= lo:
            hi = lo + 1e-8
        self.min_val = torch.tensor(lo)
        self.max_val = torch.tensor(hi)
        self.histogram += torch.histc(x.float(), self.bins, lo, hi).to(torch.float64)

    def _rebin(self, hist, lo, hi, new_lo, new_hi):
        """Spread old bin counts onto the new grid in proportion to overlap."""
        n = self.bins
        new_edges = torch.linspace(new_lo, new_hi, n + 1, dtype=torch.float64)
        cum = torch.cat([torch.zeros(1, dtype=torch.float64), hist.cumsum(0)])
        # cumulative count at each new edge, interpolating inside old bins
        pos = ((new_edges - lo) / max(hi - lo, 1e-12) * n).clamp(0, n)
        i = pos.floor().long().clamp(max=n - 1)
        frac = pos - i
        at = cum[i] + frac * (cum[i + 1] - cum[i])
        return (at[1:] - at[:-1]).clamp(min=0)

    def range(self):
        if not self.calibrated:
            return self.min_val, self.max_val
        n = self.bins
        lo, hi = float(self.min_val), float(self.max_val)
        width = (hi - lo) / n
        centers = lo + (torch.arange(n, dtype=torch.float64) + 0.5) * width
        hist = self.histogram
        qmin, qmax = qrange(self.dtype, self.reduce_range)
        levels = qmax - qmin
        # candidate clippings: shrink each end toward 0 (0 stays inside); all pairs at once
        fracs = torch.linspace(0.0, 0.95, self.candidates, dtype=torch.float64)
        a = (lo * (1 - fracs)).reshape(-1, 1, 1)            # (k, 1, 1)
        b = (hi * (1 - fracs)).reshape(1, -1, 1)            # (1, k, 1)
        step2 = ((b - a) / levels) ** 2 / 12.0               # (k, k, 1)
        c = centers.reshape(1, 1, -1)
        per_value = torch.where(c < a, (c - a) ** 2, torch.where(c > b, (c - b) ** 2, step2))
        err = (per_value * hist).sum(-1)                     # (k, k)
        err = torch.where((b - a).squeeze(-1) > 0, err, torch.full_like(err, float("inf")))
        i, j = divmod(int(torch.argmin(err)), err.shape[1])
        best_range = (float(a.reshape(-1)[i]), float(b.reshape(-1)[j]))
        return torch.tensor(best_range[0]), torch.tensor(best_range[1])


class PercentileObserver(Observer):
    """The range between the ``lower``-th and ``upper``-th percentiles of everything seen
    (kept as a bounded reservoir of values; deterministic sub-sampling)."""

    def __init__(self, lower: float = 0.01, upper: float = 99.99, max_samples: int = 1 << 20, **kw):
        super().__init__(**kw)
        if not 0.0 <= lower < upper <= 100.0:
            raise ValueError(f"need 0 <= lower < upper <= 100, got {lower}, {upper}")
        self.lower, self.upper, self.max_samples = lower, upper, max_samples
        self._samples = []
        self._n = 0

    def observe(self, x):
        flat = x.reshape(-1).float()
        if flat.numel() > self.max_samples // 16:
            stride = -(-flat.numel() // (self.max_samples // 16))
            flat = flat[::stride]
        self._samples.append(flat.clone())
        self._n += flat.numel()
        if self._n > self.max_samples:
            allv = torch.cat(self._samples)[::2].clone()
            self._samples, self._n = [allv], allv.numel()
        mn, mx = torch.aminmax(flat)
        self.min_val = torch.minimum(self.min_val, mn)
        self.max_val = torch.maximum(self.max_val, mx)

    def range(self):
        if not self._samples:
            return self.min_val, self.max_val
        v = torch.cat(self._samples)
        q = torch.tensor([self.lower / 100.0, self.upper / 100.0])
        if v.numel() > 1 << 24:
            v = v[:: -(-v.numel() // (1 << 24))]
        lo, hi = torch.quantile(v, q).tolist()
        return torch.tensor(lo), torch.tensor(hi)

    def __getstate__(self):
        state = self.__dict__.copy()
        if self._samples:  # keep the chosen range, not the samples
            lo, hi = self.range()
            state["_samples"] = [torch.stack([lo, hi]).float()]
            state["_n"] = 2
        return state


class FixedQParamsObserver(Observer):
    """Fixed parameters, independent of the data (outputs with a known range)."""

    def __init__(self, scale: float, zero_point: int, dtype: torch.dtype = torch.uint8):
        super().__init__(dtype=dtype)
        self.scale, self.zero_point = float(scale), int(zero_point)
        self.count += 1  # always "calibrated"

    def observe(self, x):
        pass

    def qparams(self) -> QParams:
        qmin, qmax = qrange(self.dtype)
        return QParams(self.scale, self.zero_point, self.dtype, qmin, qmax)

    def describe(self):
        qp = self.qparams()
        return {"observer": "FixedQParams", "min": (qp.qmin - qp.zero_point) * qp.scale,
                "max": (qp.qmax - qp.zero_point) * qp.scale}

    def extra_repr(self) -> str:
        return f"scale={self.scale}, zero_point={self.zero_point}, dtype={self.dtype}"
