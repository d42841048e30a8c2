"""The API keys in force: read at start (a bad file stops the gateway, naming the file and
line), read again on SIGHUP or `llmserve reload-keys` (a bad file is reported and the keys in
force stay)."""

from __future__ import annotations

import logging
from collections.abc import Callable

from gateway.api_keys import ApiKeys, KeysFileError, load_api_keys
from gateway.auth import tenant_of
from gateway.settings import GatewaySettings

log = logging.getLogger("gateway")


class KeyTable:
    def __init__(self, settings: GatewaySettings) -> None:
        self.settings = settings
        self.classes = settings.classes()
        self.on_reload: Callable[[KeyTable], None] | None = None  # the metrics' hook
        try:
            self.keys = self._read()
        except KeysFileError as err:
            raise SystemExit(str(err)) from None

    def _read(self) -> ApiKeys:
        path = self.settings.api_keys_file
        if path:
            return load_api_keys(path, self.classes)
        try:
            key = self.settings.api_key()
        except SystemExit as err:  # the one key's file, empty or unreadable
            raise KeysFileError(str(err)) from None
        return ApiKeys.single(key, tenant_of(key))

    def __call__(self) -> ApiKeys:
        return self.keys

    def reload(self) -> ApiKeys:
        """The file read again and in force; KeysFileError (the keys in force kept) if bad."""
        try:
            keys = self._read()
        except KeysFileError as err:
            log.error("API keys not reloaded, the previous ones stay: %s", err)
            raise
        self.keys = keys
        if self.on_reload is not None:
            self.on_reload(self)
        log.info("API keys reloaded: %s", self.summary())
        return keys

    def summary(self) -> str:
        keys = self.keys
        if not keys.required:
            return "no key (every request is the default tenant's)"
        tenants = ", ".join(f"{t} (weight {e.weight:g})" for t, e in keys.tenants.items())
        return f"{len(keys.entries)} keys of {len(keys.tenants)} tenants: {tenants}"
