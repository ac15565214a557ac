"""eepctl: the operator's CLI for elastic expert-parallel MoE deployments on Ray."""
