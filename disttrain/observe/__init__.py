"""What every rank is doing while a run trains: stragglers named from each rank's step phases."""
