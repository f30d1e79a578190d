"""How the store meets training frameworks.

``hierps.deepspeed`` (:mod:`hierps.integrations.deepspeed`, with its ``"hierarchical_ps"`` config
section in :mod:`~hierps.integrations.config` and :class:`~hierps.integrations.loader.PassLoader`)
plugs the store into DeepSpeed; :mod:`~hierps.integrations.transport` and
:mod:`~hierps.integrations.horovod` carry the sharded store's collectives over torch.distributed
or Horovod.
"""
