/* The SVG line plot of svg.h. */
#include "svg.h"

#include <math.h>

enum { W = 860, HGT = 520, ML = 78, MR = 24, MT = 44, MB = 58, MAX_POINTS = 2000 };

/* Colour-blind-safe palette (Okabe-Ito), cycled. */
static const char *const palette[] = {"#0072B2", "#D55E00", "#009E73", "#CC79A7",
                                      "#E69F00", "#56B4E9", "#000000", "#F0E442"};

static void put_escaped(FILE *f, const char *s)
{
    for (; s && *s; s++) {
        switch (*s) {
        case '<': fputs("&lt;", f); break;
        case '>': fputs("&gt;", f); break;
        case '&': fputs("&amp;", f); break;
        case '"': fputs("&quot;", f); break;
        default: fputc(*s, f);
        }
    }
}

static int usable(double v) { return isfinite(v) && v > 0; }

/* A step of 1, 2 or 5 times a power of ten giving about `want` intervals. */
static double nice_step(double span, int want)
{
    double raw = span / want, p = pow(10, floor(log10(raw))), m = raw / p;
    return (m < 1.5 ? 1 : m < 3.5 ? 2 : m < 7.5 ? 5 : 10) * p;
}

int svg_log_plot(FILE *f, const char *title, const char *xlabel, const char *ylabel, int nseries,
                 const char *const *names, const double *const *y, int64_t npoints)
{
    const double pw = W - ML - MR, ph = HGT - MT - MB;
    double lo = INFINITY, hi = -INFINITY;
    for (int s = 0; s < nseries; s++)
        for (int64_t i = 0; i < npoints; i++)
            if (usable(y[s][i])) {
                double l = log10(y[s][i]);
                lo = l < lo ? l : lo;
                hi = l > hi ? l : hi;
            }
    if (!(lo <= hi)) /* nothing to plot: an empty frame over one decade */
        lo = -1, hi = 0;
    if (hi - lo < 0.3) { /* a flat curve still gets a readable axis */
        double mid = 0.5 * (lo + hi);
        lo = mid - 0.15, hi = mid + 0.15;
    }
    double pad = 0.04 * (hi - lo);
    lo -= pad, hi += pad;
    double x0 = 1, x1 = npoints > 1 ? (double)npoints : 2;
#define PX(x) (ML + ((x) - x0) / (x1 - x0) * pw)
#define PY(l) (MT + (hi - (l)) / (hi - lo) * ph)

    fprintf(f, "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"%d\" height=\"%d\" viewBox=\"0 0 %d %d\" "
               "font-family=\"sans-serif\" font-size=\"12\">\n", W, HGT, W, HGT);
    fprintf(f, "<rect width=\"%d\" height=\"%d\" fill=\"white\"/>\n", W, HGT);
    fprintf(f, "<text x=\"%d\" y=\"24\" text-anchor=\"middle\" font-size=\"15\">", W / 2);
    put_escaped(f, title);
    fputs("</text>\n", f);

    /* y grid: decades, plus 2 and 5 (or every digit) when few decades show */
    double span = hi - lo;
    static const int digits_all[] = {1, 2, 3, 4, 5, 6, 7, 8, 9}, digits_125[] = {1, 2, 5}, digits_1[] = {1};
    const int *digits = span < 0.8 ? digits_all : span <= 2.5 ? digits_125 : digits_1;
    int ndigits = span < 0.8 ? 9 : span <= 2.5 ? 3 : 1;
    int dstep = span > 8 ? (int)ceil(span / 8) : 1;
    for (int d = (int)floor(lo); d <= (int)ceil(hi); d++) {
        if (ndigits == 1 && ((d % dstep) + dstep) % dstep)
            continue;
        for (int j = 0; j < ndigits; j++) {
            double v = digits[j] * pow(10, d), l = log10(v);
            if (l < lo || l > hi)
                continue;
            double py = PY(l);
            fprintf(f, "<line x1=\"%d\" y1=\"%.1f\" x2=\"%.1f\" y2=\"%.1f\" stroke=\"#%s\"/>\n", ML, py, ML + pw, py,
                    digits[j] == 1 ? "cccccc" : "eeeeee");
            fprintf(f, "<text x=\"%d\" y=\"%.1f\" text-anchor=\"end\">%.3g</text>\n", ML - 6, py + 4, v);
        }
    }
    /* x grid */
    double xs = nice_step(x1 - x0, 8);
    for (double v = ceil(x0 / xs) * xs; v <= x1 + 1e-9; v += xs) {
        double px = PX(v);
        fprintf(f, "<line x1=\"%.1f\" y1=\"%d\" x2=\"%.1f\" y2=\"%.1f\" stroke=\"#eeeeee\"/>\n", px, MT, px, MT + ph);
        fprintf(f, "<text x=\"%.1f\" y=\"%.1f\" text-anchor=\"middle\">%.0f</text>\n", px, MT + ph + 18, v);
    }
    fprintf(f, "<rect x=\"%d\" y=\"%d\" width=\"%.0f\" height=\"%.0f\" fill=\"none\" stroke=\"black\"/>\n", ML, MT,
            pw, ph);
    fprintf(f, "<text x=\"%.1f\" y=\"%d\" text-anchor=\"middle\">", ML + pw / 2, HGT - 14);
    put_escaped(f, xlabel);
    fputs("</text>\n", f);
    fprintf(f, "<text transform=\"translate(18 %.1f) rotate(-90)\" text-anchor=\"middle\">", MT + ph / 2);
    put_escaped(f, ylabel);
    fputs("</text>\n", f);

    /* curves: a polyline per run of plottable points, at most MAX_POINTS */
    int64_t stride = (npoints + MAX_POINTS - 1) / MAX_POINTS;
    stride = stride < 1 ? 1 : stride;
    for (int s = 0; s < nseries; s++) {
        const char *col = palette[s % (int)(sizeof palette / sizeof palette[0])];
        int open = 0;
        for (int64_t i = 0; i < npoints; i++) {
            if (i % stride && i != npoints - 1)
                continue;
            double v = y[s][i];
            if (!usable(v)) {
                if (open)
                    fputs("\"/>\n", f);
                open = 0;
                continue;
            }
            if (!open)
                fprintf(f, "<polyline fill=\"none\" stroke=\"%s\" stroke-width=\"1.6\" points=\"", col);
            fprintf(f, "%s%.1f,%.1f", open ? " " : "", PX((double)(i + 1)), PY(log10(v)));
            open = 1;
        }
        if (open)
            fputs("\"/>\n", f);
    }
    /* legend, top right inside the frame */
    double lx = ML + pw - 170, ly = MT + 10;
    fprintf(f, "<rect x=\"%.1f\" y=\"%.1f\" width=\"160\" height=\"%d\" fill=\"white\" fill-opacity=\"0.85\" "
               "stroke=\"#999999\"/>\n", lx, ly, 8 + 18 * nseries);
    for (int s = 0; s < nseries; s++) {
        double yy = ly + 17 + 18 * s;
        fprintf(f, "<line x1=\"%.1f\" y1=\"%.1f\" x2=\"%.1f\" y2=\"%.1f\" stroke=\"%s\" stroke-width=\"2.5\"/>\n",
                lx + 8, yy - 4, lx + 34, yy - 4, palette[s % (int)(sizeof palette / sizeof palette[0])]);
        fprintf(f, "<text x=\"%.1f\" y=\"%.1f\">", lx + 42, yy);
        put_escaped(f, names[s]);
        fputs("</text>\n", f);
    }
    fputs("</svg>\n", f);
#undef PX
#undef PY
    return ferror(f) ? -1 : 0;
}
