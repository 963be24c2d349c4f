"""DiLoCo's outer loop and its streaming fragments."""
