"""``hierps.deepspeed``: the DeepSpeed integration, importable under the short name.

The code lives in :mod:`hierps.integrations.deepspeed`; ``import hierps.deepspeed`` and
``hierps.deepspeed.initialize(...)`` reach it.
"""

from hierps.integrations.deepspeed import *  # noqa: F403
from hierps.integrations.deepspeed import __all__  # noqa: F401
