"""Device mesh from config, logical-axis rules, param/batch/optimizer sharding, multi-host init."""
