"""The controller side: orchestration, recovery, routing, plans and rank clients. Torch-free
(an import-linter contract checks it): the controller actor and the process launcher's parent
run it without the model."""
