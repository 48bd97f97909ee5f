"""plan: which layouts a model can run in, and what each rank of one will hold, without starting
it (``scripts/plan.py``). ``states``: every rank's parameter, gradient and optimizer bytes, from
the rank's own model built on the meta device and ZeRO's prediction of its stage's peaks."""
