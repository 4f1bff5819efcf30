"""Small helpers every layer may use: device copies and warnings at the user's line; imports nothing of the package."""
