"""Where onebit meets the outside: configs and lr schedules, trainers, AMP,
torchft, examples, docs and packaging."""
