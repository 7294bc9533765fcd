"""One rank's gradients and their exact norms: the model resolved once, the gradients a collect
reads, the float64 math (bands, rows, rescaling, the norm engine), GradScaler awareness and the step
hooks."""
