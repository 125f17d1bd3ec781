"""A sentence-transformers checkpoint's Dense modules (export writes them as artifact.manifest.DENSE_FILE),
applied in numpy after the model's own pooling, as sentence-transformers applies them."""
from __future__ import annotations

from pathlib import Path

import numpy as np

from artifact.manifest import DENSE_FILE, Manifest, ManifestError


def _gelu(v: np.ndarray) -> np.ndarray:
    """torch.nn.GELU() (exact: x/2 * erfc(-x/sqrt 2)); numpy has no erfc, so Numerical Recipes' erfcc, whose
    relative error is under 1.2e-7 everywhere, in float64."""
    x = np.asarray(v, dtype=np.float64)
    z = np.abs(x) / np.sqrt(2.0)  # erfc's argument is -x/sqrt 2
    t = 1.0 / (1.0 + 0.5 * z)
    poly = (-1.26551223 + t * (1.00002368 + t * (0.37409196 + t * (0.09678418 + t * (-0.18628806 + t * (
        0.27886807 + t * (-1.13520398 + t * (1.48851587 + t * (-0.82215223 + t * 0.17087277)))))))))
    tail = t * np.exp(-z * z + poly)  # erfc(z) for z >= 0
    erfc = np.where(x < 0, tail, 2.0 - tail)  # erfc(-x/sqrt 2)
    return (0.5 * x * erfc).astype(np.float32)


_ACTIVATIONS = {
    "tanh": np.tanh,
    "identity": lambda v: v,
    "relu": lambda v: np.maximum(v, np.float32(0)),
    "sigmoid": lambda v: np.float32(1) / (np.float32(1) + np.exp(-v)),
    "gelu": _gelu,
}


class SentenceDense:
    def __init__(self, layers: list[tuple[np.ndarray, np.ndarray | None, str]]):
        self.layers = layers  # (weight [out, in], bias [out] or None, activation)

    @classmethod
    def load(cls, folder: Path | str, manifest: Manifest) -> SentenceDense | None:
        """The artifact's Dense modules, None when it has none; ManifestError when the file does not hold
        what the manifest says."""
        if not manifest.sentence_dense:
            return None
        path = Path(folder) / DENSE_FILE
        try:
            with np.load(path, allow_pickle=False) as arrays:
                layers = [(arrays[f"{i}.weight"].astype(np.float32), arrays[f"{i}.bias"].astype(np.float32)
                           if layer["bias"] else None, layer["activation"])
                          for i, layer in enumerate(manifest.sentence_dense)]
        except (OSError, KeyError, ValueError) as e:
            raise ManifestError(f"{path} cannot be read as the Dense layers the manifest names ({e}); "
                                f"re-export the model") from e
        for (weight, bias, _), layer in zip(layers, manifest.sentence_dense):
            want = (layer["out_features"], layer["in_features"])
            if weight.shape != want or (bias is not None and bias.shape != want[:1]):
                raise ManifestError(f"{path}: a Dense layer's weights are not {want[0]} x {want[1]}; re-export the model")
        return cls(layers)

    def __call__(self, vectors: np.ndarray) -> np.ndarray:
        """[n, in] pooled vectors -> [n, out]."""
        for weight, bias, activation in self.layers:
            vectors = vectors @ weight.T
            if bias is not None:
                vectors += bias
            vectors = _ACTIVATIONS[activation](vectors)
        return np.asarray(vectors, dtype=np.float32)
