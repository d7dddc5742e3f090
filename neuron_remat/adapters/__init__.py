"""Adapters for host libraries that have no ``jax_remat_policy`` hook.

Each module imports its host library only when one of its functions is called:
`flax` (linen ``nn.remat`` and NNX ``nnx.remat``), `equinox` (``eqx.filter_checkpoint``),
`axlearn` (``RematSpec`` settings and a trainer-config modifier) and `maxtext` (config
overrides for ``remat_policy: custom``). The plain-JAX adapter is
`neuron_remat.checkpoint`.
"""
