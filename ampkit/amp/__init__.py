"""The mixed-precision engine: loss scalers, combined unscaling, opt levels, casting."""
