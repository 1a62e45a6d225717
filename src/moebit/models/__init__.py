"""Models trained by moebit."""
