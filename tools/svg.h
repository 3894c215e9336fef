/* A self-contained SVG line plot (fm-train's loss curves): no plotting
 * dependency, any browser shows it. */
#ifndef FM_SVG_H
#define FM_SVG_H

#include <stdint.h>
#include <stdio.h>

/* Plots `nseries` curves y[s][0..npoints) against x = 1..npoints with a
 * logarithmic y axis: axes with ticks and grid, a title, a legend, one
 * coloured polyline per curve. Points that are not finite and positive are
 * left out (the line breaks there). 0 on success, -1 on a write error. */
int svg_log_plot(FILE *f, const char *title, const char *xlabel, const char *ylabel, int nseries,
                 const char *const *names, const double *const *y, int64_t npoints);

#endif
