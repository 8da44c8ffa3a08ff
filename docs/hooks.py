"""MkDocs hooks of the docs site (``docs/mkdocs.yml`` names this file).

The site's pages are the Markdown files of ``docs/`` itself, beside ``mkdocs.yml``. MkDocs
refuses a ``docs_dir`` that is the config file's own folder when it validates the config, so
``mkdocs.yml`` names a child folder and ``on_config`` (which runs after validation, before any
page is read) points ``docs_dir`` at ``docs/``.
"""

from __future__ import annotations

import os
from typing import Any


def on_config(config: Any) -> Any:
    config.docs_dir = os.path.dirname(os.path.abspath(config.config_file_path))
    return config
