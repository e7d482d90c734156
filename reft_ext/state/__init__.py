"""What a rank's training state is: its byte layout (regions), identity and metadata codec."""
