"""``advise --emit RUNTIME``: write the recommended plan as the config that RUNTIME runs.

With ``--emit``, ``--output`` names the config file (default: :data:`EMIT_FILES`) and the report
goes to standard output. The search serves ``--target`` when given, else the emitted runtime, so
``--emit accelerate`` recommends only what Accelerate can train; ``--target deepspeed --emit
accelerate`` writes a DeepSpeed-through-Accelerate config.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from stratagem.advisor.search.advice import Advice

EMIT_FILES = {"accelerate": "accelerate.yaml", "deepspeed": "ds_config.json", "lightning": "trainer.yaml"}
"""Runtime → the file ``--emit`` writes when ``--output`` is not given."""


EMIT_TARGETS = {"accelerate": ("accelerate", "deepspeed"), "deepspeed": ("deepspeed",), "lightning": ("lightning",)}
"""Runtime → the ``--target``s whose plans its config can run (Accelerate runs DeepSpeed's too)."""


def search_target(*, emit: str | None, target: str | None) -> str:
    """The target the search serves: ``--target``, else the ``--emit`` runtime, else ``any``.
    :class:`UsageError` for a ``--target`` whose plans the ``--emit`` config cannot run."""
    if emit and target and target not in EMIT_TARGETS[emit]:
        from stratagem.errors import UsageError

        raise UsageError(f"--emit {emit} writes a config for plans {emit} runs, and --target {target} asks for "
                         f"plans {'any runtime' if target == 'any' else target} can run\nHINT: leave --target "
                         f"out (it follows --emit), or give --target {' or '.join(EMIT_TARGETS[emit])}")
    return target or emit or "any"


def export_config(runtime: str, advice: Advice, output: Path | None) -> Path:
    """Write the best plan of ``advice`` as ``runtime``'s config to ``output`` (or the default
    file); returns the path written."""
    assert advice.best is not None, "export_config needs a recommended plan"
    plan, path = advice.best.plan, output or Path(EMIT_FILES[runtime])
    if runtime == "accelerate":
        from stratagem.integrations.accelerate import export_accelerate_config

        export_accelerate_config(plan, advice.cluster, path, block_classes=advice.profile.block_classes,
                                 deepspeed=advice.target == "deepspeed")
    elif runtime == "deepspeed":
        from stratagem.integrations.deepspeed import deepspeed_notes, export_deepspeed_config

        export_deepspeed_config(plan, path)
        for note in deepspeed_notes(plan):
            print(f"advise: note: {note}", file=sys.stderr)
    else:
        from stratagem.integrations.lightning_config import (
            LIGHTNING_CLI_REQUIREMENT,
            export_lightning_config,
            lightning_cli_missing,
        )

        export_lightning_config(plan, advice.cluster, path, block_classes=advice.profile.block_classes)
        if missing := lightning_cli_missing():
            print(f"advise: note: LightningCLI reads {path} only with {LIGHTNING_CLI_REQUIREMENT}, which is not "
                  f"installed here: {missing} (or the stratagem[lightning] extra)", file=sys.stderr)
    print(f"advise: wrote the {runtime} config for {plan.name} to {path}", file=sys.stderr)
    return path
