"""The published models the simulation runs: their gradients, FLOPs and compute timelines.

``bench/simulate.py`` needs, per model, each gradient's name and bytes (what
the cost model plans), when backward makes each one final (what the step
model overlaps), and for PowerSGD each matrix's shape. They come from the
models' published architectures, not from a framework, so the simulation
runs without torchvision or a BERT implementation:

- VGG19: configuration E of Simonyan and Zisserman (ICLR 2015, Table 1), in
  torchvision's parameter layout (38 tensors, 143,667,240 parameters: HiPress
  Table 6's 548 MB and 392 MB fc6);
- BERT-large: Devlin et al. (NAACL 2019, Sec. 3: L=24, H=1024, A=16, FFN
  4096, vocabulary 30522) with its pooler and a 2-class head (393 tensors,
  the names of ``cost_model.presets``' ``bert-large``).

A layer's forward FLOPs per sample (2 per multiply-add) set its share of
backward (``flop_timeline``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Tuple

from hipress_like.tuning.compute import ComputeTimeline

__all__ = ["Layer", "MODELS", "vgg19_layers", "bert_large_layers", "sizes_of",
           "flop_timeline", "powersgd_ratio"]

F32 = 4


@dataclass(frozen=True)
class Layer:
    """One parameter tensor: its name (the framework's), shape, and the forward FLOPs
    per sample of the layer it belongs to (charged to the layer's first tensor)."""

    name: str
    shape: Tuple[int, ...]
    flops: float

    @property
    def nbytes(self) -> int:
        """float32 bytes."""
        n = 1
        for d in self.shape:
            n *= d
        return n * F32


def vgg19_layers() -> List[Layer]:
    """VGG19 (configuration E of Simonyan and Zisserman 2015) in torchvision's layout.

    ``features.i`` counts ReLU and max-pool modules too, as torchvision does;
    a 3x3 convolution costs ``2 * 9 * cin * cout * H * W`` FLOPs per image on
    its H x W output (224 halving after each pool), a linear layer
    ``2 * in * out``.
    """
    out: List[Layer] = []
    cin, idx, side = 3, 0, 224
    for ch, reps in [(64, 2), (128, 2), (256, 4), (512, 4), (512, 4)]:
        for _ in range(reps):
            out.append(Layer(f"features.{idx}.weight", (ch, cin, 3, 3),
                             2.0 * 9 * cin * ch * side * side))
            out.append(Layer(f"features.{idx}.bias", (ch,), 0.0))
            cin, idx = ch, idx + 2  # the conv and its ReLU
        idx += 1  # the max-pool
        side //= 2
    for j, (fin, fout) in zip((0, 3, 6), [(512 * 7 * 7, 4096), (4096, 4096), (4096, 1000)]):
        out.append(Layer(f"classifier.{j}.weight", (fout, fin), 2.0 * fin * fout))
        out.append(Layer(f"classifier.{j}.bias", (fout,), 0.0))
    return out


def bert_large_layers(seq: int = 128, vocab: int = 30522, hidden: int = 1024,
                      layers: int = 24, ffn: int = 4096, classes: int = 2) -> List[Layer]:
    """BERT-large (Devlin et al. 2019, Sec. 3: L=24, H=1024, A=16) with a classifier head.

    Per token, a matrix of ``a x b`` costs ``2ab`` FLOPs forward; attention's
    scores and weighted sum ``4 * seq * hidden`` per token and layer (the 16
    heads split ``hidden``, so their number does not change the count);
    embedding lookups cost nothing. Names follow the preset
    ``cost_model.presets`` (``bert-large``).
    """
    h = hidden
    out = [Layer("embeddings.word.weight", (vocab, h), 0.0),
           Layer("embeddings.position.weight", (512, h), 0.0),
           Layer("embeddings.token_type.weight", (2, h), 0.0),
           Layer("embeddings.ln.gamma", (h,), 0.0), Layer("embeddings.ln.beta", (h,), 0.0)]
    for i in range(layers):
        p = f"encoder.{i}."
        for m in ("query", "key", "value", "attn_out"):
            extra = 4.0 * seq * h if m == "attn_out" else 0.0  # scores and weighted sum
            out += [Layer(p + m + ".weight", (h, h), 2.0 * h * h + extra),
                    Layer(p + m + ".bias", (h,), 0.0)]
        out += [Layer(p + "attn_ln.gamma", (h,), 0.0), Layer(p + "attn_ln.beta", (h,), 0.0),
                Layer(p + "ffn1.weight", (ffn, h), 2.0 * ffn * h),
                Layer(p + "ffn1.bias", (ffn,), 0.0),
                Layer(p + "ffn2.weight", (h, ffn), 2.0 * h * ffn),
                Layer(p + "ffn2.bias", (h,), 0.0),
                Layer(p + "ffn_ln.gamma", (h,), 0.0), Layer(p + "ffn_ln.beta", (h,), 0.0)]
    out += [Layer("pooler.weight", (h, h), 2.0 * h * h), Layer("pooler.bias", (h,), 0.0),
            Layer("classifier.weight", (classes, h), 2.0 * classes * h),
            Layer("classifier.bias", (classes,), 0.0)]
    return out


MODELS = {"vgg19": vgg19_layers, "bert-large": bert_large_layers}


def sizes_of(model: str) -> List[Tuple[str, int]]:
    """(name, bytes) in registration order."""
    return [(x.name, x.nbytes) for x in MODELS[model]()]


def flop_timeline(model: str, compute_s: float, update_s: float = 0.0) -> ComputeTimeline:
    """The compute timeline of one step: forward a third, backward two thirds of
    ``compute_s``; backward runs the layers in reverse, each taking its share of
    the FLOPs, and a layer's tensors are final when its backward ends (where
    ``ComputeTimeline.spread`` would spread by bytes, which puts VGG19's 392 MB
    fc6 weight, 0.3% of its FLOPs, at 70% of backward).

    Raises:
        ValueError: a negative time.
    """
    if not (compute_s >= 0 and update_s >= 0):
        raise ValueError(f"compute times must be >= 0 seconds, found {compute_s!r} and "
                         f"{update_s!r}")
    layers = MODELS[model]()
    fwd, bwd = compute_s / 3, compute_s * 2 / 3
    flops = sum(x.flops for x in layers) or 1.0
    ready, done = {}, 0.0
    # a layer's FLOPs sit on its first tensor; going backwards, its later tensors
    # (bias, beta) are final together with it
    pending: List[str] = []
    for x in reversed(layers):
        pending.append(x.name)
        if x.flops > 0 or x is layers[0]:
            done += x.flops
            for name in pending:
                ready[name] = bwd * done / flops
            pending = []
    return ComputeTimeline(fwd, bwd, ready, update_s, f"{compute_s * 1e3:.0f} ms, "
                           "spread by FLOPs")


def powersgd_ratio(model: str, rank: int) -> float:
    """PowerSGD's payload bytes per gradient byte over the model's matrices.

    A gradient of ``a x b`` (a convolution's reshaped to ``out x in*k*k``)
    sends P (``a x r``) and Q (``b x r``): ``r (a + b) / (a b)`` of it
    (HiPress Sec. 2.4); weighted by bytes over every tensor of two or more
    dimensions (vectors are not compressed; the planner leaves them
    uncompressed anyway, being small).
    """
    if not isinstance(rank, int) or rank < 1:
        raise ValueError(f"PowerSGD's rank must be an integer >= 1, found {rank!r}")
    r, num, den = rank, 0.0, 0.0
    for x in MODELS[model]():
        if len(x.shape) < 2:
            continue
        a = x.shape[0]
        b = x.nbytes // F32 // a
        num += min(r * (a + b), a * b)
        den += a * b
    return num / den
