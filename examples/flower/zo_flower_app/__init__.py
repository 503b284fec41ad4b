"""A Flower App running zo_byzantine's federated zeroth-order, Byzantine-robust fine-tuning."""
