"""The ServerApp: zo_byzantine's server role (plans, validation, robust aggregation, ledger) on the SuperLink."""

from zo_byzantine.flower import server_app

app = server_app()
