"""In-cluster actors: rank actors, the per-deployment registry, and the controller.

Imported only inside the cluster or by eepctl commands that talk to it (never at import
time of eepctl itself)."""
