"""Hardware tests: they run only where JAX's default backend is Neuron."""

import functools

import pytest


@functools.lru_cache(maxsize=1)
def _backend() -> str:
    try:
        import jax

        return jax.default_backend()
    except Exception as err:  # noqa: BLE001
        return f"unavailable ({err})"


@pytest.fixture(autouse=True)
def _needs_neuron():
    backend = _backend()
    if backend != "neuron":
        pytest.skip(f"needs a Neuron backend: jax.default_backend() is {backend!r}; run on a "
                    "trn2 instance with jax-neuronx from the AWS Neuron pip repository")
