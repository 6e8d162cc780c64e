"""The web config of Prometheus exporters, and the rules it sets for the endpoint: this
exporter's counterpart of exporter-toolkit's `web` package, which node_exporter and
dcgm-exporter import apart from their own HTTP handlers.

- file: the file's format (`--web.config.file`): TLS, headers, bcrypt users, rate limit,
  with exporter-toolkit's keys, defaults and checks.
- security: the file kept current (reloaded on change, the last good reading kept), the TLS
  context for each handshake, and each request's rate limit and basic auth (`admit`).
- basic_auth: a password against the file's bcrypt hashes, remembered as exporter-toolkit does.

exporter.http serves with it: its access check calls `admit`, its guard asks whether a
connection's client certificate is allowed.
"""
