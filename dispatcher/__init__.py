"""What runs near the user: submit, resume, status, results, monitor."""
