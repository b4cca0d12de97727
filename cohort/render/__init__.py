"""What the cohort command shows people: the terminal (`terminal`) and the HTML page (`page`)."""
