"""Apply a Plan with torch-native composable APIs on a DeviceMesh."""
