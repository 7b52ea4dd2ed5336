"""The model layer: what each of a served model's layers computes, decided once when the engine loads it."""
