"""The ClientApp: zo_byzantine's client role (catch-up from the ledger, seeded perturbed forwards) on a SuperNode."""

from zo_byzantine.flower import client_app

app = client_app()
