"""The job on one worker: the rank agreement, the steps and epochs, what a step carries and a checkpoint holds, and
the averages, generators and checks around them."""
