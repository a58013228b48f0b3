"""stratagem: how should I parallelize this model on this cluster?

The advisor (``stratagem.advisor``) profiles a model and a cluster and ranks parallel plans;
the plugins (``stratagem.plugins``) apply a plan with torch-native APIs; the integrations
(``stratagem.integrations``) bring both to Lightning, Accelerate and DeepSpeed.

Importing this package stays light: nothing here imports lightning or accelerate. When
``lightning`` is already imported, it registers ``Trainer(strategy="auto-parallel")``; otherwise
``import stratagem.integrations.lightning`` does (see that module). Likewise, when
``lightning.fabric`` is already imported, it registers ``Fabric(strategy="auto-parallel")``
(``stratagem.integrations.fabric``).
"""

import sys

__version__ = "0.1.0"

if "lightning.pytorch" in sys.modules:
    from stratagem.integrations import lightning as _lightning  # noqa: F401  (registers on import)
if "lightning.fabric" in sys.modules:
    from stratagem.integrations import fabric as _fabric  # noqa: F401  (registers on import)

__all__ = ["__version__"]
