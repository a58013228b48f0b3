"""stratagem: how should I parallelize this model on this cluster?

The advisor (``stratagem.advisor``) profiles a model and a cluster and ranks parallel plans;
the plugins (``stratagem.plugins``) apply a plan with torch-native APIs; the integrations
(``stratagem.integrations``) bring both to Lightning, Accelerate and DeepSpeed.

Importing this package stays light: nothing here imports lightning or accelerate.
"""

__version__ = "0.1.0"

__all__ = ["__version__"]
