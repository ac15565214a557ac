"""Client-side drivers: how eepctl talks to a deployment of each engine kind."""
